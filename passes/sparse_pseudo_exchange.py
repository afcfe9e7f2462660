"""A sparse exchange as SparseLoCo's (Sarfi et al., 2025) and DeMo's (Peng et al., 2024) authors compute it: per
tile of a buffer kept on each rank, the top-k entries, all-gathered, and each entry averaged over the ranks that
sent it.

Not a pass. ``diloco-outer-step`` with ``topk > 0`` calls :func:`exchange` with each parameter's error buffer
(SparseLoCo); ``demo-exchange`` with each parameter's momentum and DeMo's DCT bases. Each buffer is cut into tiles
(``sparse_tiles.py``: 64 × 64 for a 768 × 3072 matrix at chunk 64), one row per tile, or with a basis the tile's
2-D DCT coefficients. Per row, ``torch.topk(|x|, k, sorted=False)`` picks ``k`` entries (:meth:`Sparsity.k`:
SparseLoCo scales ``topk`` by the tile's size, ``max(1, round(h·w·topk / chunk²))``; DeMo takes it as it is),
and only they leave the rank, as one message per exchange. The parameters whose tiles have the same width and
k form a group (:func:`groups_of`, in order of first appearance), their rows one after another, so a group takes
one top-k, one packing and one scatter whatever its number of parameters; the message is, group after group:

- their indices in the row, ``ceil(log2(h·w))`` bits each, packed little-endian into bytes (bit ``j`` of the
  part is bit ``j mod b`` of index ``j div b``; the last byte padded with zero bits);
- their values: the float32 bytes as they are; or with ``bins`` (SparseLoCo's statistical quantiser, per
  tensor: :func:`quantise`, each parameter of the group its own) a code of ``ceil(log2(bins))`` bits each,
  packed the same way;
- with ``bins``, after every group's parts, a float32 table per parameter, in the parameters' order: its shift
  and the mean of each bin, ``bins + 1`` floats.

Each part is padded with zero bytes to a multiple of 4, so the float32 parts are read in place from the gathered
buffer, compiled or not. What is sent is the decoded value, so the rank subtracts exactly that from its buffer
(through the inverse basis for DeMo). Every rank decodes every rank's message and, per entry, adds the values of
the ranks that chose it in rank order (``scatter_add``, one rank at a time, so the order is fixed on any device)
and divides by how many did: the authors' ``scatter_reduce(mean, include_self=False)``, bit for bit on the CPU.
An entry no rank chose is zero.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.program import StepProgram

from .sparse_tiles import Tiling, from_rows, to_rows

aten = torch.ops.aten
MAX_BINS = 256  # the authors' codes are uint8
SERIAL_REDUCTION = 32768  # torch's GRAIN_SIZE: a CPU sum of more elements than this may be split between threads


@dataclass(frozen=True)
class Sparsity:
    """What an exchange keeps: ``topk`` per tile of at most ``chunk`` × ``chunk`` (``scaled``: the top-k of a
    chunk² tile, scaled to the tile's size), in float32 or, with ``bins``, quantised per tensor in bins of
    ``sigmas·σ / bins`` around the mean (``sigmas·σ`` wide in all)."""

    chunk: int
    topk: int
    scaled: bool
    bins: int = 0
    sigmas: float = 6.0

    def k(self, width: int) -> int:
        """Entries kept of a tile of ``width``, at least 1 and at most all."""
        k = int(max(1, round(width * self.topk / self.chunk**2))) if self.scaled else self.topk
        return min(max(k, 1), width)

    @property
    def code_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.bins)))


def check_options(bins: int, who: str) -> None:
    """``bins``: 0 (float32 values) or 2 to :data:`MAX_BINS`. ``who`` names what sends (``SparseLoCo``, ``DeMo``)."""
    if bins == 1 or bins > MAX_BINS:
        raise ConfigurationError(
            f"quantization_bins={bins}: {who} quantises to 2 to {MAX_BINS} bins (4 is the published 2 bits), or "
            "sends float32 values with 0."
        )


def index_bits(width: int) -> int:
    """Bits of one index into a row of ``width`` entries (at least 1)."""
    return max(1, math.ceil(math.log2(width)))


def part_bytes(rows: int, width: int, k: int, sparsity: Sparsity) -> tuple[int, int, int]:
    """Bytes of the indices and values of ``rows`` tiles of ``width`` with ``k`` kept (one group of
    :func:`groups_of`, or one parameter alone), and of one parameter's table (shift and bin means), each padded to
    a multiple of 4."""
    count = rows * k
    indices = _aligned(math.ceil(count * index_bits(width) / 8))
    if not sparsity.bins:
        return indices, 4 * count, 0
    return indices, _aligned(math.ceil(count * sparsity.code_bits / 8)), 4 * (sparsity.bins + 1)


def message_parts(shapes: tuple[tuple[int, int, int], ...], sparsity: Sparsity) -> dict[str, int]:
    """Bytes of one rank's message by part (``indices``, ``values``, ``tables``) for parameters of ``(rows,
    width, k)``: each group's indices and values, each parameter's table."""
    sizes = [part_bytes(sum(shapes[i][0] for i in g), *shapes[g[0]][1:], sparsity) for g in groups_of(shapes)]
    tables = len(shapes) * part_bytes(1, 1, 1, sparsity)[2]
    return {"indices": sum(s[0] for s in sizes), "values": sum(s[1] for s in sizes), "tables": tables}


def _aligned(size: int) -> int:
    return size + (-size) % 4


def _padded(part: torch.Tensor) -> torch.Tensor:
    """Bytes padded with zeros to a multiple of 4."""
    return torch.nn.functional.pad(part, (0, (-part.numel()) % 4))


def _word(bits: int) -> tuple[int, int] | None:
    """Codes per word and bytes per word when ``bits``-bit codes fill whole bytes in one int64 (``lcm(bits, 8)``
    bits of at most 56, and a little-endian host); None: pack bit by bit."""
    width = math.lcm(bits, 8)
    return (width // bits, width // 8) if width <= 56 and sys.byteorder == "little" else None


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2^bits`` (any shape) to bytes, ``bits`` each, little-endian (module doc): a
    word of ``lcm(bits, 8)`` bits at a time where one fits in an int64, else bit by bit (the same bytes)."""
    flat = codes.reshape(-1).to(torch.int64)
    size = math.ceil(flat.numel() * bits / 8)
    word = _word(bits)
    if word is None:
        stream = ((flat.unsqueeze(1) >> torch.arange(bits, device=flat.device)) & 1).reshape(-1)
        stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
        return (stream.reshape(-1, 8) << torch.arange(8, device=flat.device)).sum(1).to(torch.uint8)
    per, width = word
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % per)).reshape(-1, per)
    words = (flat << (torch.arange(per, device=flat.device) * bits)).sum(1, keepdim=True)
    return words.view(torch.uint8)[:, :width].reshape(-1)[:size]


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` integers of ``bits`` bits each that :func:`pack_bits` wrote, as int64."""
    word = _word(bits)
    if word is None:
        stream = ((data.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=data.device)) & 1).reshape(-1)
        digits = stream[: count * bits].reshape(count, bits)
        return (digits << torch.arange(bits, device=data.device)).sum(1)
    per, width = word
    rows = torch.nn.functional.pad(data, (0, (-data.numel()) % width)).reshape(-1, width)
    words = torch.nn.functional.pad(rows, (0, 8 - width)).contiguous().view(torch.int64)
    codes = (words >> (torch.arange(per, device=data.device) * bits)) & (2**bits - 1)
    return codes.reshape(-1)[:count]


def quantise(values: torch.Tensor, bins: int, sigmas: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseLoCo's quantiser over each row of ``values`` (``[P, n]``: the kept values of P tensors, each its own):
    the codes (int64, ``[P, n]``), the shifts (each row's mean, ``[P, 1]``) and the lookups (the mean of ``v −
    shift`` in each bin, 0 for an empty bin: ``[P, bins]``). ``σ = ‖v − shift‖ / √(n − 1)``, ``scale =
    sigmas·σ / bins`` (1 where that is 0 or not finite), ``code = clamp(round((v − shift)/scale + bins//2), 0,
    bins − 1)``. A row's mean and norm are the bits of that tensor's own while ``n`` is at most
    :data:`SERIAL_REDUCTION` (above it torch's CPU kernels split one tensor's sum between threads), so the callers
    quantise longer tensors one at a time."""
    shift = values.mean(dim=1, keepdim=True)
    centred = values - shift
    p, n = centred.shape
    spread = centred.norm(dim=1, keepdim=True) / math.sqrt(n - 1) if n > 1 else torch.zeros_like(shift)
    scale = sigmas * spread / bins
    scale = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    codes = (centred / scale + bins // 2).round().clamp(0, bins - 1).to(torch.int64)
    slots = (codes + torch.arange(p, device=values.device).unsqueeze(1) * bins).reshape(-1)  # row r's bins: r·bins…
    sums = torch.zeros(p * bins, dtype=torch.float32, device=values.device).scatter_add(0, slots, centred.reshape(-1))
    counts = torch.zeros_like(sums).scatter_add(0, slots, torch.ones_like(centred).reshape(-1))
    return codes, shift, torch.where(counts > 0, sums / counts, 0.0).reshape(p, bins)


def dequantise(codes: torch.Tensor, shift: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    """A code's value: its bin's mean plus the shift (each row its own, as :func:`quantise` gives them)."""
    return torch.gather(lookup, 1, codes) + shift


def _quantised(values: torch.Tensor, rows: list[int], spec: Sparsity) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A group's kept values (``[Σ rows, k]``, its parameters' rows one after another, equal counts adjacent)
    quantised per parameter: the codes and what they decode to (each ``[Σ rows, k]``), and each parameter's table
    (shift, then the bin means). Parameters of the same rows go through :func:`quantise` together."""
    k, codes, decoded, tables, first = values.shape[1], [], [], [], 0
    for count, size in _runs(rows, SERIAL_REDUCTION // max(1, k)):
        block = values[first : first + count * size].reshape(count, size * k)
        code, shift, lookup = quantise(block, spec.bins, spec.sigmas)
        codes.append(code.reshape(-1, k))
        decoded.append(dequantise(code, shift, lookup).reshape(-1, k))
        tables += list(torch.cat([shift, lookup], dim=1))
        first += count * size
    return _stacked(codes), _stacked(decoded), tables


def _runs(rows: list[int], most: int) -> list[tuple[int, int]]:
    """``rows`` as runs ``(how many, rows)`` of equal adjacent counts, a run of counts above ``most`` one by one."""
    runs: list[tuple[int, int]] = []
    for size in rows:
        if runs and runs[-1][1] == size and size <= most:
            runs[-1] = (runs[-1][0] + 1, size)
        else:
            runs.append((1, size))
    return runs


def groups_of(shapes: tuple[tuple[int, int, int], ...]) -> list[list[int]]:
    """The parameters (indices into ``shapes``, ``(rows, width, k)`` each) whose tiles have the same width and k,
    in order of first appearance, each group's by their rows (stable): one top-k, one packing and one scatter per
    group, their rows one after another (a model's layers share a few such shapes)."""
    found: dict[tuple[int, int], list[int]] = {}
    for i, (_, width, k) in enumerate(shapes):
        found.setdefault((width, k), []).append(i)
    return [sorted(members, key=lambda i: shapes[i][0]) for members in found.values()]


def _stacked(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def select(rows: list[torch.Tensor], ks: tuple[int, ...], spec: Sparsity) -> tuple[torch.Tensor, ...]:
    """One rank's tiles (``[rows, width]`` per parameter, ``ks`` entries kept of each row): its message (uint8,
    1-D) and, per group of :func:`groups_of`, what the message decodes to, dense (zero where nothing was sent):
    the group's parameters' rows one after another. Each row's top-k and each parameter's quantiser are what they
    would be alone, so grouping changes no bit."""
    shapes = tuple((x.shape[0], x.shape[1], k) for x, k in zip(rows, ks))
    parts, tables, sent = [], {}, []
    for members in groups_of(shapes):
        x = _stacked([rows[i] for i in members])
        index = torch.topk(x.abs(), ks[members[0]], dim=-1, largest=True, sorted=False).indices
        values = torch.gather(x, -1, index)
        parts.append(_padded(pack_bits(index, index_bits(x.shape[-1]))))
        if spec.bins:  # per parameter, as the authors quantise each tensor
            codes, values, own = _quantised(values, [shapes[i][0] for i in members], spec)
            tables |= dict(zip(members, own))
            parts.append(_padded(pack_bits(codes, spec.code_bits)))
        else:
            parts.append(values.reshape(-1).view(torch.uint8))
        sent.append(torch.zeros_like(x).scatter_(-1, index, values))
    if spec.bins:
        parts.append(torch.cat([tables[i] for i in range(len(rows))]).view(torch.uint8))
    return (torch.cat(parts), *sent)


def decode_mean(received: torch.Tensor, shapes: tuple[tuple[int, int, int], ...], spec: Sparsity) -> tuple:
    """Every rank's message (``[W, message bytes]``) decoded; per group of :func:`groups_of` (parameters of
    ``(rows, width, k)``), each entry the mean of the values of the ranks that sent it, added in rank order (0
    where none did), the group's parameters' rows one after another."""
    groups = groups_of(shapes)
    spans = [(sum(shapes[i][0] for i in g), shapes[g[0]][1], shapes[g[0]][2]) for g in groups]
    sums = [torch.zeros(r, w, dtype=torch.float32, device=received.device) for r, w, _ in spans]
    counts = [torch.zeros_like(total) for total in sums]
    chosen: list[list[torch.Tensor]] = [[] for _ in groups]
    sizes = [part_bytes(*span, spec)[:2] for span in spans]
    tables = sum(index + values for index, values in sizes)
    owners = [  # each row's parameter, to look its table up: only with bins (DeMo's float32 values need none)
        torch.tensor([i for i in g for _ in range(shapes[i][0])], device=received.device) if spec.bins else None
        for g in groups
    ]
    for message in received:
        at = 0
        table = message[tables:].view(torch.float32).reshape(len(shapes), -1) if spec.bins else None
        for g, ((rows, width, k), (index_size, value_size)) in enumerate(zip(spans, sizes)):
            index = unpack_bits(message[at : at + index_size], index_bits(width), rows * k).reshape(rows, k)
            body = message[at + index_size : at + index_size + value_size]
            if table is not None:
                codes = unpack_bits(body, spec.code_bits, rows * k).reshape(rows, k)
                own = table[owners[g]]  # the row's parameter's shift and bin means: dequantise's sum, per row
                values = torch.gather(own[:, 1:], 1, codes) + own[:, :1]
            else:
                values = body.view(torch.float32).reshape(rows, k)
            sums[g].scatter_add_(1, index, values)
            counts[g].scatter_add_(1, index, torch.ones_like(values))
            chosen[g].append(index)
            at += index_size + value_size
    means = []
    for total, count, indices in zip(sums, counts, chosen):  # divided where sent only: the rest stays zero
        where = torch.cat(indices, dim=1)
        means.append(torch.zeros_like(total).scatter_(1, where, total.gather(1, where) / count.gather(1, where)))
    return tuple(means)


def select_call(
    rows: list[torch.Tensor], ks: list[int], chunk: int, topk: int, scaled: bool, bins: int, sigmas: float
) -> list[torch.Tensor]:
    """:func:`select` called with a graph node's arguments: the body of ``transpiler::sparse_select``, and the
    node's target itself in a program Inductor compiles (``inline``), where Dynamo traces it."""
    return list(select(rows, tuple(ks), Sparsity(chunk, topk, scaled, bins, sigmas)))


def decode_call(
    received: torch.Tensor, shapes: list[int], chunk: int, topk: int, scaled: bool, bins: int, sigmas: float
) -> list[torch.Tensor]:
    """:func:`decode_mean` called as :func:`select_call`; ``shapes`` the ``(rows, width, k)`` of each parameter, in
    a row."""
    triples = tuple(tuple(shapes[i : i + 3]) for i in range(0, len(shapes), 3))
    return list(decode_mean(received, triples, Sparsity(chunk, topk, scaled, bins, sigmas)))


_select_op = torch.library.custom_op("transpiler::sparse_select", select_call, mutates_args=())
_decode_op = torch.library.custom_op("transpiler::sparse_decode_mean", decode_call, mutates_args=())


@_select_op.register_fake
def _select_fake(rows, ks, chunk, topk, scaled, bins, sigmas):
    spec = Sparsity(chunk, topk, scaled, bins, sigmas)
    shapes = tuple((x.shape[0], x.shape[1], k) for x, k in zip(rows, ks))
    size = sum(message_parts(shapes, spec).values())
    dense = [rows[0].new_empty(sum(shapes[i][0] for i in g), shapes[g[0]][1]) for g in groups_of(shapes)]
    return [rows[0].new_empty(size, dtype=torch.uint8), *dense]


@_decode_op.register_fake
def _decode_fake(received, shapes, chunk, topk, scaled, bins, sigmas):
    triples = tuple(tuple(shapes[i : i + 3]) for i in range(0, len(shapes), 3))
    return [
        received.new_empty(sum(triples[i][0] for i in g), triples[g[0]][1], dtype=torch.float32)
        for g in groups_of(triples)
    ]


SELECT = torch.ops.transpiler.sparse_select.default
DECODE_MEAN = torch.ops.transpiler.sparse_decode_mean.default


def exchange(
    program: StepProgram,
    cursor: Cursor,
    buffers: dict[str, fx.Node],
    sparsity: Sparsity,
    bases: Callable[[int], tuple[fx.Node, fx.Node]] | None = None,
    info: dict | None = None,
    inline: bool = False,
) -> tuple[dict[str, fx.Node], dict[str, fx.Node]]:
    """Send the top-k of every tile of the buffers ``buffers`` (by parameter); returns the mean over the ranks
    that chose each entry and the buffer left on this rank (``e − ê``), each by parameter in the parameter's
    shape. With ``bases`` (the forward and inverse DCT of a tile side, graph constants) the top-k is taken of each
    tile's coefficients; what was sent leaves the buffer through the inverse, and the mean comes back through it.
    The selection and the decoding are one graph op each (``transpiler::sparse_select``, ``sparse_decode_mean``),
    or with ``inline`` (a program Inductor compiles) Python calls Dynamo traces, so Inductor compiles them too."""
    comm = {"role": "communication"}
    tilings = {name: Tiling.of(tuple(node.meta["val"].shape), sparsity.chunk) for name, node in buffers.items()}

    def basis(tiling: Tiling, which: int) -> list[fx.Node]:
        return [bases(side)[which] for side in tiling.sides] if bases else []

    rows = [
        cursor.emit(to_rows, (node, t.matrix, t.sides, *basis(t, 0)), **comm)
        for node, t in zip(buffers.values(), tilings.values())
    ]
    ks = [sparsity.k(t.width) for t in tilings.values()]
    fields = (sparsity.chunk, sparsity.topk, sparsity.scaled, sparsity.bins, sparsity.sigmas)
    chosen = cursor.emit(select_call if inline else SELECT, (rows, ks, *fields), **comm)
    message = cursor.emit(operator.getitem, (chosen, 0), **comm, sent=True)  # all that leaves the rank
    size = message.meta["val"].numel()
    shapes = tuple((t.rows, t.width, k) for t, k in zip(tilings.values(), ks))
    world, group = program.world_size, program.group_name
    info = (info or {"kind": "pseudo-gradients", "pseudo-gradients": tuple(buffers)}) | {
        "topk": sparsity.topk,
        "chunk": sparsity.chunk,
        "bins": sparsity.bins,
        "bytes": size,
        "parts": message_parts(shapes, sparsity),
    }
    gathered = cursor.emit(C10D.all_gather_into_tensor.default, (message, world, group), collective=info, **comm)
    received = cursor.emit(aten.view.default, (cursor.emit(WAIT, (gathered,), **comm), [world, size]), **comm)
    decoded = cursor.emit(
        decode_call if inline else DECODE_MEAN, (received, [n for shape in shapes for n in shape], *fields), **comm
    )
    places = {}  # each parameter's group and its first row and rows there
    for g, members in enumerate(groups_of(shapes)):
        firsts = [sum(shapes[j][0] for j in members[:n]) for n in range(len(members))]
        places |= {i: (g, first, shapes[i][0], len(members)) for i, first in zip(members, firsts)}
    outputs: dict[tuple[fx.Node, int], fx.Node] = {}

    def back(source: fx.Node, skip: int, i: int, t: Tiling) -> fx.Node:
        """Parameter ``i``'s rows of ``source``'s group outputs (after ``skip`` others), back to its shape."""
        g, first, count, size = places[i]
        if (source, g) not in outputs:
            outputs[source, g] = cursor.emit(operator.getitem, (source, skip + g), **comm)
        rows = outputs[source, g]
        if size > 1:
            rows = cursor.emit(aten.slice.Tensor, (rows, 0, first, first + count), **comm)
        return cursor.emit(from_rows, (rows, t.shape, t.matrix, t.sides, *basis(t, 1)), **comm)

    sent = [back(chosen, 1, i, tilings[name]) for i, name in enumerate(buffers)]
    kept = dict(zip(buffers, cursor.emit_each(aten._foreach_sub.List, (list(buffers.values()), sent), **comm)))
    means = {name: back(decoded, 0, i, tilings[name]) for i, name in enumerate(buffers)}
    return means, kept
