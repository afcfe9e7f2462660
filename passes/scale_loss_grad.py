"""``scale-loss-grad``: multiply the loss-gradient seed by 1/world_size.

Requires: a traced step whose seed node has role ``loss_grad``.
Guarantees: every gradient is this rank's share of the global mean, so a sum
all-reduce yields the average (Paddle's ``_insert_scale_loss_grad_ops``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram

from .gradient_flow import scale_seed


@dataclass(frozen=True)
class ScaleLossGrad(Pass):
    name = "scale-loss-grad"
    summary = "multiply the loss-gradient seed by 1/world_size (Paddle scale_loss_grad)"

    def run(self, program: StepProgram) -> bool:
        if any("loss_grad_scale" in n.meta for n in program.graph.nodes):
            return False
        scale = 1.0 / program.world_size
        scale_seed(program, scale, loss_grad_scale=scale)
        return True
