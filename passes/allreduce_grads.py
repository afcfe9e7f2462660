"""``allreduce-grads``: one sum all-reduce per gradient (Paddle ``GradAllReduce``).

Requires: gradient nodes tagged ``grad_of``; usually runs after
``scale-loss-grad`` so the sum is a mean.
Guarantees: each gradient not yet reduced gets an ``all_reduce`` issued right
after the node that produces it and a ``wait_tensor`` right before its first
use; every former reader of the gradient reads the waited result.
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.graph.edit import move_before, position
from transpiler.graph.pipeline import ReducingPass
from transpiler.graph.program import StepProgram

from .bucketing import reduce_in_buckets
from .gradient_flow import replace_gradient, unreduced_gradients


@dataclass(frozen=True)
class AllReduceGrads(ReducingPass):
    name = "allreduce-grads"
    summary = "one sum all-reduce per gradient, issued after it is produced, waited before first use"

    def run(self, program: StepProgram) -> bool:
        grads = unreduced_gradients(program)
        order = position(program.graph)  # computed once: the readers are original nodes
        first_readers = [min(g.users, key=order.__getitem__) for g in grads]
        items = [(g.meta["grad_of"], g) for g in grads]
        for grad, reader, reduced in zip(grads, first_readers, reduce_in_buckets(program, items, 0, 0, tag="grads")):
            replace_gradient(grad, reduced)
            move_before(reduced, reader)
        return bool(grads)
