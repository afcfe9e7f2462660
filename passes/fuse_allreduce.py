"""``fuse-allreduce``: coalesce gradients into buckets, one all-reduce per bucket.

Requires: gradient nodes tagged ``grad_of`` (not yet reduced).
Guarantees: gradients are grouped in production order into buckets that
never mix dtypes or devices and stay within the byte cap (a gradient larger
than the cap gets a bucket of its own); the first bucket of each dtype uses
``first-bucket-mb`` as DDP does. A bucket is flattened into one buffer, reduced
once and read back through views; a one-gradient bucket is reduced in place of
the gradient, without copies. ``bucket-cap-mb=0`` gives one bucket per
gradient. Each all-reduce carries ``meta["collective"]`` with its members.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.collectives import C10D, WAIT
from transpiler.graph_edit import Cursor, node_bytes, position
from transpiler.pipeline import Pass
from transpiler.program import StepProgram

from .allreduce_grads import gradient_nodes, is_reduced

MB = 1024 * 1024
aten = torch.ops.aten


def bucket_key(node: fx.Node) -> tuple[str, str]:
    val = node.meta["val"]
    return str(val.dtype), str(val.device)


def assign_buckets(sizes: list[int], keys: list[tuple], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Partition item indices into buckets, in order, one open bucket per key.

    An item joins its key's open bucket unless that would exceed the cap; the
    first bucket of each key has ``first_cap_bytes``. ``cap_bytes <= 0`` puts
    every item alone. Buckets come back ordered by their last item.
    """
    open_bucket: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed: dict[tuple, int] = {}
    done: list[list[int]] = []
    for i, (size, key) in enumerate(zip(sizes, keys)):
        if cap_bytes <= 0:
            done.append([i])
            continue
        cap = first_cap_bytes if closed.get(key, 0) == 0 else cap_bytes
        if key in open_bucket and open_bytes[key] + size > cap:
            done.append(open_bucket.pop(key))
            closed[key] = closed.get(key, 0) + 1
        if key not in open_bucket:
            open_bucket[key], open_bytes[key] = [], 0
        open_bucket[key].append(i)
        open_bytes[key] += size
    done.extend(open_bucket.values())
    return sorted(done, key=lambda b: b[-1])


@dataclass(frozen=True)
class FuseAllReduce(Pass):
    name = "fuse-allreduce"
    summary = "coalesce gradients into dtype/size buckets, one all-reduce per bucket"
    reduces_gradients = True
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0

    def run(self, program: StepProgram) -> bool:
        grads = [g for g in gradient_nodes(program) if not is_reduced(g)]
        if not grads:
            return False
        buckets = assign_buckets(
            [node_bytes(g) for g in grads],
            [bucket_key(g) for g in grads],
            int(self.bucket_cap_mb * MB),
            int(self.first_bucket_mb * MB),
        )
        order = position(program.graph)  # gradients keep their order; computed once for linear time
        for index, members in enumerate(buckets):
            last = max((grads[i] for i in members), key=order.__getitem__)
            self._reduce_bucket(program, [grads[i] for i in members], index, last)
        return True

    def _reduce_bucket(self, program: StepProgram, members: list[fx.Node], index: int, last: fx.Node) -> None:
        graph = program.graph
        cursor = Cursor(graph, last)
        info = {
            "kind": "all_reduce",
            "bucket": index,
            "grads": tuple(g.meta["grad_of"] for g in members),
            "bytes": sum(node_bytes(g) for g in members),
        }
        comm = {"role": "communication", "bucket": index}
        if len(members) == 1:
            flat = members[0]
        else:
            pieces = [cursor.emit(aten.reshape.default, (g, [-1]), **comm) for g in members]
            flat = cursor.emit(aten.cat.default, (pieces,), **comm)
        # a fused buffer is ours alone, so it is reduced in place (no clone); a lone gradient is not
        op = C10D.all_reduce.default if len(members) == 1 else C10D.all_reduce_.default
        reduced = cursor.emit(op, (flat, "sum", program.group_name), collective=info, **comm)
        waited = cursor.emit(WAIT, (reduced,), **comm)
        if len(members) == 1:
            members[0].replace_all_uses_with(waited, delete_user_cb=lambda u: u is not reduced)
            return
        sizes = [g.meta["val"].numel() for g in members]
        chunks = cursor.emit(aten.split_with_sizes.default, (waited, sizes), **comm)
        for i, g in enumerate(members):
            piece = cursor.emit(operator.getitem, (chunks, i), **comm)
            shaped = cursor.emit(aten.view.default, (piece, list(g.meta["val"].shape)), **comm)
            g.replace_all_uses_with(shaped, delete_user_cb=lambda u: u.meta.get("bucket") != index)
