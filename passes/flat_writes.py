"""What a flat buffer holds once ``flatten-update``'s runs have written it, as a value later passes can read.

Not a pass. ``flatten-update`` writes each run's new values into its range of a flat buffer (``copy_`` with
``meta["writes_back"]``; ``reinplace-optimizer`` later runs the run in place there and drops the copy). A pass
that reads the buffer after the update (``gather-params`` sends this rank's shard of the parameters,
``local-sgd-average`` averages them) must read it *after* those writes, which only a data dependency
guarantees: :func:`written_value` builds the range from the runs' values, zeros where no run writes
(padding between runs, a rank's elements of no parameter). :func:`laid_out` is that assembly for any pieces
(``gather-params`` builds a rank's shard of per-parameter slices with it too).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.graph.edit import Cursor
from transpiler.graph.program import StepProgram
from transpiler.graph.views import flat_range

aten = torch.ops.aten


def run_writes(program: StepProgram, flat: fx.Node) -> list[tuple[int, int, fx.Node]]:
    """The ranges ``[lo, hi)`` of ``flat`` that the update writes, with the value each gets, in order."""
    found = []
    for node in program.graph.nodes:
        if node.target is aten.copy_.default and node.meta.get("writes_back"):
            root, lo, hi = flat_range(node.args[0])
            if root is flat and hi > lo:
                found.append((lo, hi, node.args[1]))
    return sorted(found, key=lambda write: write[0])


def written_value(program: StepProgram, flat: fx.Node, lo: int, hi: int, cursor: Cursor, **meta) -> fx.Node:
    """Elements ``[lo, hi)`` of ``flat`` after the update wrote it (a new tensor, or a run's value where one run
    covers them all), emitted at ``cursor``."""
    return laid_out(cursor, run_writes(program, flat), lo, hi, flat, **meta)


def laid_out(
    cursor: Cursor, pieces: list[tuple[int, int, fx.Node]], lo: int, hi: int, like: fx.Node, **meta
) -> fx.Node:
    """Elements ``[lo, hi)`` of a flat layout whose ranges ``[a, b)`` hold ``pieces`` (in order, not
    overlapping), cut to the range, zeros between them: one piece alone where it covers it all, else a ``cat``.
    The gaps are views of one zero buffer as long as the longest (a bucket's aligned slots leave a gap after
    most parameters: one allocation, not one per gap). ``like`` gives the zeros' dtype and device."""
    parts: list[fx.Node | int] = []  # a piece, or the length of a gap
    end = lo
    for a, b, value in pieces:
        if b <= lo or a >= hi or b == a:
            continue
        if a < lo or b > hi:
            value = cursor.emit(aten.slice.Tensor, (value, 0, max(lo - a, 0), min(hi, b) - a), **meta)
        if max(a, lo) > end:
            parts.append(max(a, lo) - end)
        parts.append(value)
        end = min(b, hi)
    if hi > end:
        parts.append(hi - end)
    gaps = [p for p in parts if isinstance(p, int)]
    if gaps:
        zeros = cursor.emit(aten.new_zeros.default, (like, [max(gaps)]), **meta)
        parts = [p if not isinstance(p, int) else _first(cursor, zeros, p, max(gaps), meta) for p in parts]
    return parts[0] if len(parts) == 1 else cursor.emit(aten.cat.default, (parts,), **meta)


def _first(cursor: Cursor, zeros: fx.Node, n: int, length: int, meta: dict) -> fx.Node:
    """The first ``n`` of ``length`` zeros (the buffer itself where that is all of it)."""
    return zeros if n == length else cursor.emit(aten.slice.Tensor, (zeros, 0, 0, n), **meta)
