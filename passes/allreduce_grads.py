"""``allreduce-grads``: one sum all-reduce per gradient (Paddle ``GradAllReduce``).

Requires: gradient nodes tagged ``grad_of``; usually runs after
``scale-loss-grad`` so the sum is a mean.
Guarantees: each gradient not yet reduced gets an ``all_reduce`` issued right
after the node that produces it and a ``wait_tensor`` right before its first
use; every former reader of the gradient reads the waited result.
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.collectives import C10D, WAIT
from transpiler.graph_edit import Cursor, move_before, node_bytes, position
from transpiler.pipeline import Pass
from transpiler.program import StepProgram


def gradient_nodes(program: StepProgram) -> list:
    """Gradients in the order the backward pass produces them."""
    return [n for n in program.graph.nodes if "grad_of" in n.meta]


def is_reduced(grad) -> bool:
    return any(u.meta.get("role") == "communication" for u in grad.users)


@dataclass(frozen=True)
class AllReduceGrads(Pass):
    name = "allreduce-grads"
    summary = "one sum all-reduce per gradient, issued after it is produced, waited before first use"
    reduces_gradients = True

    def run(self, program: StepProgram) -> bool:
        graph = program.graph
        order = position(graph)  # original nodes keep their order; computed once for linear time
        changed = False
        for grad in gradient_nodes(program):
            if is_reduced(grad):
                continue
            name = grad.meta["grad_of"]
            first_reader = min(grad.users, key=order.__getitem__)
            cursor = Cursor(graph, grad)
            info = {"kind": "all_reduce", "grads": (name,), "bytes": node_bytes(grad)}
            reduced = cursor.emit(
                C10D.all_reduce.default, (grad, "sum", program.group_name), role="communication", collective=info
            )
            waited = cursor.emit(WAIT, (reduced,), role="communication")
            grad.replace_all_uses_with(waited, delete_user_cb=lambda u, r=reduced: u is not r)
            move_before(waited, first_reader)
            changed = True
        return changed
