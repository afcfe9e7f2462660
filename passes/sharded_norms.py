"""Norms of tensors that every rank holds a slice of (a sharded optimizer), from the slices' norms.

``clip-grad-norm`` needs each gradient's norm, and an optimizer with a per-tensor trust ratio (LAMB, LARS)
each parameter's and each update's; under ``shard-optimizer`` a rank holds only its slice of each. The
whole norm is ``(sum over ranks of norm(slice)^p)^(1/p)`` (for the inf-norm, their maximum): one all-reduce of
every slice norm, stacked, gives them all, the same on every rank. It differs from the norm of the whole
tensor in the last bits (another summation order).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.program import StepProgram

aten = torch.ops.aten


def norms_over_ranks(
    program: StepProgram, cursor: Cursor, partial: list[fx.Node], norm_type: float, names: tuple[str, ...]
) -> fx.Node:
    """The whole norms (1-D, one per entry of ``partial``: each a 0-d norm of this rank's slice) from one
    all-reduce. ``names`` say whose norms they are, in the collective's meta."""
    stacked = cursor.emit(aten.stack.default, (partial,), role="optimizer")
    infinite = norm_type == float("inf")
    if not infinite:
        stacked = cursor.emit(aten.pow.Tensor_Scalar, (stacked, norm_type), role="optimizer")
    info = {"kind": "all_reduce", "norm": names, "bytes": len(partial) * stacked.meta["val"].element_size()}
    reduced = cursor.emit(
        C10D.all_reduce.default,
        (stacked, "max" if infinite else "sum", program.group_name),
        role="communication",
        collective=info,
    )
    total = cursor.emit(WAIT, (reduced,), role="communication")
    if infinite:
        return total
    return cursor.emit(aten.pow.Tensor_Scalar, (total, 1.0 / norm_type), role="optimizer")
