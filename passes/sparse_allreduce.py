"""``sparse-allreduce``: top-K (or thresholded) gradient sparsification with error feedback (SINGA).

Requires: gradient nodes tagged ``grad_of`` (not yet reduced), already each
rank's share (``scale-loss-grad`` before it).
Guarantees: for each gradient, ``x = g + residual`` (``residual.<param>``,
extra state starting at zero). The ``x`` are grouped into dtype/size buckets
as ``fuse-allreduce`` does; per bucket of ``n`` values a rank selects the
``k = ceil(ratio * n)`` entries of largest ``|x|`` (``transpiler::top_magnitudes``) and, with
``threshold > 0``, zeroes the selected values with ``|x| < threshold`` (they
stay in the residual: a static graph sends a fixed ``k`` per bucket, so
``ratio`` is the threshold mode's capacity). The indices (int64) and values
of every rank are all-gathered as one message per rank (the indices as
int32, then the values' bytes: ``k * (4 + itemsize)`` bytes; the selections
differ per rank, so a sum all-reduce cannot combine them) and added into a
dense zero buffer in rank order: the reduced gradient. The new residual is ``x - sent``, so
``sent + residual == x`` exactly. ``ratio=1`` sends everything and equals the
dense sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.options import option
from transpiler.graph.ports import RESIDUAL, ExtraInit, Port
from transpiler.graph.program import StepProgram
from transpiler.graph.top_magnitudes import TOP_MAGNITUDES

from .bucketing import BucketedGradientPass, unflatten
from .gradient_flow import add_outputs, add_state, replace_gradient

aten = torch.ops.aten


@dataclass(frozen=True)
class SparseAllReduce(BucketedGradientPass):
    name = "sparse-allreduce"
    summary = "reduce the top-K entries of gradient + residual per bucket via all-gather; keep the rest locally"
    ratio: float = option(0.01, minimum=1e-9, maximum=1.0, help="share of each bucket's entries sent per step")
    threshold: float = option(0.0, minimum=0, help="send only selected entries with |x| >= this (0: all selected)")

    def reduce(self, program: StepProgram, grads: list[fx.Node]) -> None:
        xs = []
        for grad in grads:
            name = grad.meta["grad_of"]
            residual = add_state(program, RESIDUAL + name, grad, ExtraInit.zeros_like(name))
            xs.append(Cursor(program.graph, grad).emit(aten.add.Tensor, (grad, residual), role="communication"))
        residuals: dict[fx.Node, fx.Node] = {}
        for index, members, cursor in self.buckets(program, xs):
            nodes = [xs[i] for i in members]
            names = tuple(grads[i].meta["grad_of"] for i in members)
            reduced, left = self._bucket(program, cursor, nodes, names, index)
            for i, x in zip(members, nodes):
                replace_gradient(grads[i], reduced[x])
                residuals[grads[i]] = left[x]
        add_outputs(
            program,
            list(residuals.values()),
            [Port("extra", RESIDUAL + g.meta["grad_of"]) for g in residuals],
        )

    def _bucket(
        self, program: StepProgram, cursor: Cursor, nodes: list[fx.Node], names: tuple[str, ...], index: int
    ) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
        comm = {"role": "communication", "bucket": ("grads", index)}
        pieces = [cursor.emit(aten.reshape.default, (n, [-1]), **comm) for n in nodes]
        flat = pieces[0] if len(pieces) == 1 else cursor.emit(aten.cat.default, (pieces,), **comm)
        n = flat.meta["val"].numel()
        k = max(1, math.ceil(self.ratio * n))
        idx = cursor.emit(TOP_MAGNITUDES, (flat, k), **comm)
        picked = values = cursor.emit(aten.index_select.default, (flat, 0, idx), **comm)
        if self.threshold > 0:
            keep = cursor.emit(
                aten.ge.Scalar, (cursor.emit(aten.abs.default, (values,), **comm), self.threshold), **comm
            )
            values = cursor.emit(aten.where.ScalarOther, (keep, values, 0.0), **comm)
        # x - sent, computed where something was sent only: elsewhere x - 0 is x, bit for bit (-0.0 and NaN too),
        # so two passes over the bucket (a dense `sent` and the subtraction) go
        kept = cursor.emit(aten.sub.Tensor, (picked, values), **comm)
        left = cursor.emit(aten.index_copy.default, (flat, 0, idx, kept), **comm)
        # one message per rank: the indices as int32, then the values' bytes (one collective, not two)
        dtype, size = values.meta["val"].dtype, values.meta["val"].element_size()
        small = cursor.emit(aten._to_copy.default, (idx,), {"dtype": torch.int32}, **comm)
        parts = [cursor.emit(aten.view.dtype, (t, torch.uint8), **comm) for t in (small, values)]
        message = cursor.emit(aten.cat.default, (parts,), **comm)
        world, group = program.world_size, program.group_name
        info = {"kind": "all_gather", "bucket": index, "grads": names, "k": k, "bytes": k * (4 + size)}
        out = cursor.emit(C10D.all_gather_into_tensor.default, (message, world, group), collective=info, **comm)
        rows = cursor.emit(aten.view.default, (cursor.emit(WAIT, (out,), **comm), [world, k * (4 + size)]), **comm)
        columns = {"indices": (0, 4 * k, torch.int32), "values": (4 * k, k * (4 + size), dtype)}
        got = {}
        for what, (start, end, kind) in columns.items():
            piece = cursor.emit(aten.slice.Tensor, (rows, 1, start, end), **comm)
            piece = cursor.emit(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}, **comm)
            got[what] = cursor.emit(
                aten.view.default, (cursor.emit(aten.view.dtype, (piece, kind), **comm), [-1]), **comm
            )
        where = cursor.emit(aten._to_copy.default, (got["indices"],), {"dtype": torch.int64}, **comm)
        dense = cursor.emit(aten.new_zeros.default, (got["values"], [n]), **comm)
        dense = cursor.emit(aten.index_add.default, (dense, 0, where, got["values"]), **comm)
        return unflatten(cursor, dense, nodes, comm), unflatten(cursor, left, nodes, comm)
