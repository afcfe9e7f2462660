"""``allgather-grads``: Paddle's all-gather mode (``MultiThread``, ``trans_mode="all_gather"``).

Requires: gradient nodes tagged ``grad_of`` (not yet reduced), each rank's
share (``scale-loss-grad`` before it), and the traced optimizer update.
Guarantees: gradients are grouped in dtype/size buckets; each bucket is
all-gathered, so every rank holds every rank's gradients. The optimizer is
then applied once per gathered gradient, in rank order, as Paddle replaces
each ``adam`` op by ``nranks`` of them: the traced update reads rank 0's
gradient, and ``world_size - 1`` copies of it follow, copy ``j`` reading
rank ``j``'s gradient and the parameters and optimizer state copy ``j-1``
produced. Per-step scalars the runtime computes (Adam's bias corrections, SGD's
first-step momentum) come in as extra scalar inputs ``<slot>@j``, the values
for ``j`` updates ahead, so each copy is the optimizer's own step ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import node_bytes
from transpiler.graph.pipeline import Fact, ReducingPass
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram

from .bucketing import BucketedGradientPass, unflatten
from .gradient_flow import (
    add_input,
    before_output,
    input_node,
    output_values,
    replace_gradient,
    set_output_values,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class AllGatherGrads(BucketedGradientPass):
    name = "allgather-grads"
    # it applies the traced update once per rank's gradient, so it needs that update per parameter
    requires = ReducingPass.requires | {Fact.PER_PARAMETER}
    summary = "all-gather gradients and apply the optimizer once per rank's gradient (Paddle all-gather mode)"

    def reduce(self, program: StepProgram, grads: list[fx.Node]) -> None:
        world = program.world_size
        per_rank: dict[fx.Node, list[fx.Node]] = {}  # gradient -> its value from each rank
        for index, members, cursor in self.buckets(program, grads):
            nodes = [grads[i] for i in members]
            comm = {"role": "communication", "bucket": ("grads", index)}
            pieces = [cursor.emit(aten.reshape.default, (n, [-1]), **comm) for n in nodes]
            flat = pieces[0] if len(pieces) == 1 else cursor.emit(aten.cat.default, (pieces,), **comm)
            names = tuple(n.meta["grad_of"] for n in nodes)
            info = {"kind": "all_gather", "bucket": index, "grads": names, "bytes": node_bytes(flat)}
            gathered = cursor.emit(
                C10D.all_gather_into_tensor.default, (flat, world, program.group_name), collective=info, **comm
            )
            rows = cursor.emit(aten.view.default, (cursor.emit(WAIT, (gathered,), **comm), [world, -1]), **comm)
            for j in range(world):
                row = cursor.emit(aten.select.int, (rows, 0, j), **comm)
                for n, view in unflatten(cursor, row, nodes, comm).items():
                    per_rank.setdefault(n, []).append(view)
        for grad, views in per_rank.items():
            replace_gradient(grad, views[0])
        first = output_values(program)  # the traced update's results
        for j in range(1, world):
            self._apply_again(program, j, {views[0]: views[j] for views in per_rank.values()}, first)

    @staticmethod
    def _apply_again(program: StepProgram, j: int, grads: dict[fx.Node, fx.Node], first: list[fx.Node]) -> None:
        """Copy the optimizer update once more, reading rank j's gradients and the last copy's results."""
        values = output_values(program)
        env: dict[fx.Node, fx.Node] = dict(grads)
        for i, port in enumerate(program.outputs):
            if port.kind in ("param", "state"):
                env[input_node(program, port)] = values[i]
        for port in [p for p in program.inputs if p.kind == "scalar" and "@" not in p.name]:
            slot = input_node(program, port)
            env[slot] = add_input(program, Port("scalar", f"{port.name}@{j}"), slot)
        update = [n for n in program.graph.nodes if n.meta.get("role") == "optimizer" and n.meta.get("copy", 0) == 0]
        before_output(program).copy(update, env, copy=j)
        set_output_values(
            program,
            [
                env.get(f, f) if port.kind in ("param", "state") else v
                for f, v, port in zip(first, values, program.outputs)
            ],
        )
