"""``allreduce-grads``: one sum all-reduce per gradient (Paddle ``GradAllReduce``).

Requires: gradient nodes tagged ``grad_of``; usually runs after
``scale-loss-grad`` so the sum is a mean.
Guarantees: each gradient not yet reduced gets an ``all_reduce`` issued right
after the node that produces it and a ``wait_tensor`` right before its first
use; every former reader of the gradient reads the waited result. With ``across`` (replica groups of several
ranks under a torchft quorum) the reduced gradient is summed again over axis ``across``, as soon as the group's
sum is waited for.
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.graph.edit import move_before, position
from transpiler.graph.pipeline import ReducingPass
from transpiler.graph.program import StepProgram

from .bucketing import across_option, reduce_in_buckets
from .gradient_flow import replace_gradient, unreduced_gradients


@dataclass(frozen=True)
class AllReduceGrads(ReducingPass):
    name = "allreduce-grads"
    summary = "one sum all-reduce per gradient, issued after it is produced, waited before first use"
    across: bool = across_option("each reduced gradient")

    def run(self, program: StepProgram) -> bool:
        grads = unreduced_gradients(program)
        order = position(program.graph)  # computed once: the readers are original nodes
        first_readers = [min(g.users, key=order.__getitem__) for g in grads]
        items = [(g.meta["grad_of"], g) for g in grads]
        reduced_grads = reduce_in_buckets(program, items, 0, 0, tag="grads", across=self.across)
        for grad, reader, reduced in zip(grads, first_readers, reduced_grads):
            replace_gradient(grad, reduced)
            # the group's wait, the sum across groups and its wait (or the wait alone) go right before the reader
            for node in [reduced.args[0].args[0], reduced.args[0], reduced] if self.across else [reduced]:
                move_before(node, reader)
        return bool(grads)
