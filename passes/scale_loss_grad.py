"""``scale-loss-grad``: multiply the loss-gradient seed by 1/world_size, or by 1/participants.

Requires: a traced step whose seed node has role ``loss_grad``.
Guarantees: every gradient is this rank's share of the global mean, so a sum
all-reduce yields the average (Paddle's ``_insert_scale_loss_grad_ops``).
With ``participants``, the count is not a constant of the graph but its input
``participants`` (port kind ``quorum``), which the runtime fills each step with
the number of ranks that take part in it (under a torchft quorum, its size):
the seed is multiplied by ``reciprocal(participants)``, the same float32 value
as the constant for the same count, and a change of the quorum never retraces.
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.ports import PARTICIPANTS
from transpiler.graph.program import StepProgram

from .gradient_flow import participant_count, scale_seed


@dataclass(frozen=True)
class ScaleLossGrad(Pass):
    name = "scale-loss-grad"
    summary = "multiply the loss-gradient seed by 1/world_size (Paddle scale_loss_grad)"
    participants: bool = option(
        False,
        help="divide by the step's input 'participants' (a torchft quorum's size), and by the world size when a "
        "replica group has several ranks",
    )

    def run(self, program: StepProgram) -> bool:
        if any("loss_grad_scale" in n.meta for n in program.graph.nodes):
            return False
        if not self.participants:
            scale = 1.0 / program.world_size
            scale_seed(program, scale, loss_grad_scale=scale)
            return True
        if program.world_size > 1:  # a replica group of several ranks: its own mean, then the groups' mean
            scale_seed(program, 1.0 / program.world_size)
        scale_seed(program, participant_count(program), inverse=True, loss_grad_scale=PARTICIPANTS)
        return True
