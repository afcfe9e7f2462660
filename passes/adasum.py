"""``adasum``: Adaptive Summation by recursive vector halving, distance doubling.

Requires: float gradients of one dtype (``target=grads``), or a local
optimizer step whose weight deltas are combined (``target=deltas``); the
process subgroups the strategy declared (``program.subgroups``).
Guarantees: all values are flattened into one vector ``v``. With
``local-size`` L > 1, ``v`` is first averaged inside each group of L
consecutive ranks; the groups then run AdaSum with partners
``group XOR l``. At level l = 1, 2, 4, ... a rank keeps one half of its
current segment, sends the other half to its partner and receives the
partner's copy of the half it keeps (one ``transpiler::exchange`` per level:
the level's messages are fused). Per tensor it computes, in float64, the
partial ``a·b``, ``|a|²`` and ``|b|²`` over its part, all-reduces them over the
2l ranks the level spans (one message of 3 values per tensor), and combines
``(1 - a·b/(2|a|²)) a + (1 - a·b/(2|b|²)) b`` with per-tensor coefficients,
guarded so a zero norm gives the other input. The coefficients of all tensors
are computed at once from the all-reduced statistics; each tensor then costs
two selects, a ``mul`` and an ``addcmul``. A rollback in reverse level
order exchanges segments back until every rank holds the whole result.
With one participant (world size 1, or L = world size) AdaSum is the identity.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor, position
from transpiler.graph.options import option
from transpiler.graph.p2p import EXCHANGE
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.program import StepProgram
from transpiler.graph.rank_layouts import AdaSumGeometry

from .gradient_flow import replace_gradient, unreduced_gradients

aten = torch.ops.aten
TINY = 1e-300  # guards |a|^2 in float64: a zero norm means a zero vector and a zero dot product


def adasum_vector(program: StepProgram, items: list[fx.Node], geometry: AdaSumGeometry) -> list[fx.Node]:
    """Insert the AdaSum of ``items`` after the last of them; returns one node per item, same shape."""
    order = position(program.graph)
    cursor = Cursor(program.graph, max(items, key=order.__getitem__))
    comm = {"role": "communication"}
    sizes = [n.meta["val"].numel() for n in items]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    rank = program.rank
    flat = cursor.emit(
        aten.cat.default, ([cursor.emit(aten.reshape.default, (n, [-1]), **comm) for n in items],), **comm
    )
    if geometry.local_size > 1:
        info = {"kind": "all_reduce", "adasum": "local average", "bytes": sum(sizes) * 4}
        group = program.subgroups[geometry.local_group(rank)]
        summed = cursor.emit(C10D.all_reduce_.default, (flat, "sum", group), collective=info, **comm)
        flat = cursor.emit(aten.mul.Tensor, (cursor.emit(WAIT, (summed,), **comm), 1.0 / geometry.local_size), **comm)
    lo, hi, vec, path = 0, sum(sizes), flat, []
    for level in geometry.levels:
        mid = lo + (hi - lo) // 2
        lower = (rank // geometry.local_size) & level == 0
        keep, send = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        peer = geometry.partner(level, rank)
        outgoing = cursor.emit(aten.slice.Tensor, (vec, 0, send[0] - lo, send[1] - lo), **comm)
        mine = cursor.emit(aten.slice.Tensor, (vec, 0, keep[0] - lo, keep[1] - lo), **comm)
        theirs = cursor.emit(
            EXCHANGE, (outgoing, peer, keep[1] - keep[0]), p2p={"peer": peer, "level": level, "phase": "reduce"}, **comm
        )
        group = program.subgroups[geometry.level_group(level, rank)]
        # both partners must orient the statistics alike: a is the lower partner's data, b the upper's
        first, second = (mine, theirs) if lower else (theirs, mine)
        vec = _combine(cursor, first, second, keep, offsets, sizes, group, level)
        path.append((lo, hi, keep, lower, peer, level))
        lo, hi = keep
    for plo, phi, keep, lower, peer, level in reversed(path):  # rollback: gather the halves back
        other = (phi - plo) - (keep[1] - keep[0])
        back = cursor.emit(
            EXCHANGE, (vec, peer, other), p2p={"peer": peer, "level": level, "phase": "rollback"}, **comm
        )
        vec = cursor.emit(aten.cat.default, ([vec, back] if lower else [back, vec],), **comm)
    chunks = cursor.emit(aten.split_with_sizes.default, (vec, sizes), **comm)
    return [
        cursor.emit(
            aten.view.default, (cursor.emit(operator.getitem, (chunks, i), **comm), list(n.meta["val"].shape)), **comm
        )
        for i, n in enumerate(items)
    ]


def _combine(cursor: Cursor, a: fx.Node, b: fx.Node, keep, offsets, sizes, group: str, level: int) -> fx.Node:
    """One level: per-tensor statistics over the level's ranks, then the AdaSum combination of this rank's part.

    The coefficients of all tensors are computed together, on the all-reduced statistics laid out as one
    ``(tensors, 3)`` array; each tensor then costs two selects, a ``mul`` and an ``addcmul``."""
    comm = {"role": "communication"}
    f64 = {"dtype": torch.float64}
    spans = [
        (i, max(o, keep[0]) - keep[0], min(o + s, keep[1]) - keep[0])
        for i, (o, s) in enumerate(zip(offsets, sizes))
        if max(o, keep[0]) < min(o + s, keep[1])
    ]
    stats, parts = [], []
    for _, start, end in spans:
        ai = cursor.emit(aten.slice.Tensor, (a, 0, start, end), **comm)
        bi = cursor.emit(aten.slice.Tensor, (b, 0, start, end), **comm)
        a64 = cursor.emit(aten._to_copy.default, (ai,), f64, **comm)
        b64 = cursor.emit(aten._to_copy.default, (bi,), f64, **comm)
        triple = [cursor.emit(aten.dot.default, pair, **comm) for pair in ((a64, b64), (a64, a64), (b64, b64))]
        stats.append(cursor.emit(aten.stack.default, (triple,), **comm))
        parts.append((ai, bi))
    first, last = (spans[0][0], spans[-1][0] + 1) if spans else (0, 0)
    pieces = [cursor.emit(aten.new_zeros.default, (a, [3 * first]), f64, **comm)] + stats
    pieces.append(cursor.emit(aten.new_zeros.default, (a, [3 * (len(sizes) - last)]), f64, **comm))
    local = cursor.emit(aten.cat.default, (pieces,), **comm)
    info = {"kind": "all_reduce", "adasum": f"level {level} dot/norms", "bytes": 24 * len(sizes)}
    total = cursor.emit(
        WAIT, (cursor.emit(C10D.all_reduce_.default, (local, "sum", group), collective=info, **comm),), **comm
    )
    if not parts:
        return cursor.emit(aten.slice.Tensor, (a, 0, 0, 0), **comm)
    mine = cursor.emit(aten.slice.Tensor, (total, 0, 3 * first, 3 * last), **comm)
    table = cursor.emit(aten.view.default, (mine, [-1, 3]), **comm)  # per tensor: a·b, |a|², |b|²
    dot = cursor.emit(aten.select.int, (table, 1, 0), **comm)
    coefficients = []
    for k in (1, 2):  # c = 1 - a·b / (2 |x|²); a zero norm means a zero vector and a zero dot: c = 1
        norm = cursor.emit(aten.clamp_min.default, (cursor.emit(aten.select.int, (table, 1, k), **comm), TINY), **comm)
        ratio = cursor.emit(aten.div.Tensor, (dot, cursor.emit(aten.mul.Tensor, (norm, 2.0), **comm)), **comm)
        coeff = cursor.emit(aten.rsub.Scalar, (ratio, 1.0), **comm)
        coefficients.append(cursor.emit(aten._to_copy.default, (coeff,), {"dtype": a.meta["val"].dtype}, **comm))
    out = []
    for j, (ai, bi) in enumerate(parts):
        ca, cb = (cursor.emit(aten.select.int, (c, 0, j), **comm) for c in coefficients)
        scaled = cursor.emit(aten.mul.Tensor, (ai, ca), **comm)
        out.append(cursor.emit(aten.addcmul.default, (scaled, bi, cb), **comm))
    return out[0] if len(out) == 1 else cursor.emit(aten.cat.default, (out,), **comm)


@dataclass(frozen=True)
class AdaSum(Pass):
    name = "adasum"
    summary = "AdaSum of gradients (or weight deltas) by recursive halving with point-to-point exchanges"
    target: str = option("grads", choices=("grads", "deltas"), help="what AdaSum combines")
    local_size: int = option(1, minimum=1, help="ranks per group averaged before AdaSum across groups")

    @property
    def requires(self) -> frozenset[Fact]:  # of gradients: a reduction; of deltas, after the local update
        needs = {Fact.FUNCTIONAL, Fact.UNFLATTENED}
        return frozenset(needs | {Fact.UNREDUCED, Fact.UNTOUCHED} if self.target == "grads" else needs)

    @property
    def ensures(self) -> frozenset[Fact]:
        return frozenset({Fact.REDUCED} if self.target == "grads" else ())

    @property
    def invalidates(self) -> frozenset[Fact]:
        return frozenset({Fact.UNREDUCED} if self.target == "grads" else ())

    def run(self, program: StepProgram) -> bool:
        if any(n.meta.get("p2p") or n.meta.get("collective", {}).get("adasum") for n in program.graph.nodes):
            return False
        geometry = AdaSumGeometry(program.world_size, self.local_size)
        if geometry.participants == 1 and self.local_size == 1:
            return False  # world size 1: the plain optimizer
        if self.target == "grads":
            grads = unreduced_gradients(program)
            _one_dtype(grads)
            for grad, combined in zip(grads, adasum_vector(program, grads, geometry)):
                replace_gradient(grad, combined)
            return bool(grads)
        return self._deltas(program, geometry)

    @staticmethod
    def _deltas(program: StepProgram, geometry: AdaSumGeometry) -> bool:
        output = program.graph.output_node()
        values = list(output.args[0])
        inputs = {n.meta["port"]: n for n in program.graph.nodes if n.op == "placeholder"}
        slots = [(i, inputs[port]) for i, port in enumerate(program.outputs) if port.kind == "param"]
        deltas = [
            Cursor(program.graph, values[i]).emit(aten.sub.Tensor, (values[i], old), role="communication")
            for i, old in slots
        ]
        _one_dtype(deltas)
        for (i, old), combined in zip(slots, adasum_vector(program, deltas, geometry)):
            values[i] = Cursor(program.graph, combined).emit(aten.add.Tensor, (old, combined), role="communication")
        output.args = (tuple(values),)
        return True


def _one_dtype(nodes: list[fx.Node]) -> None:
    dtypes = {str(n.meta["val"].dtype) for n in nodes}
    if len(dtypes) > 1 or not all(n.meta["val"].is_floating_point() for n in nodes):
        raise ConfigurationError(f"AdaSum combines one floating-point vector; the values have dtypes {sorted(dtypes)}.")
