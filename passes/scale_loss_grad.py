"""``scale-loss-grad``: multiply the loss-gradient seed by 1/world_size.

Requires: a traced step whose seed node has role ``loss_grad``.
Guarantees: every gradient is this rank's share of the global mean, so a sum
all-reduce yields the average (Paddle's ``_insert_scale_loss_grad_ops``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transpiler.graph_edit import Cursor
from transpiler.pipeline import Pass
from transpiler.program import StepProgram


@dataclass(frozen=True)
class ScaleLossGrad(Pass):
    name = "scale-loss-grad"
    summary = "multiply the loss-gradient seed by 1/world_size (Paddle scale_loss_grad)"

    def run(self, program: StepProgram) -> bool:
        graph = program.graph
        if any("loss_grad_scale" in n.meta for n in graph.nodes):
            return False
        seeds = [n for n in graph.nodes if n.meta.get("role") == "loss_grad"]
        if len(seeds) != 1:
            raise ValueError(f"expected one loss-gradient seed node, found {len(seeds)}")
        seed = seeds[0]
        scale = 1.0 / program.world_size
        scaled = Cursor(graph, seed).emit(
            torch.ops.aten.mul.Tensor, (seed, scale), role="loss_grad", loss_grad_scale=scale
        )
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        return True
