"""A sparse exchange: per chunk, the top-k entries of a buffer kept on each rank, quantised, all-gathered, and
summed in float32 in rank order. SparseLoCo's (Sarfi et al., 2025) and, in a DCT basis, DeMo's (Peng et al., 2024).

Not a pass. ``diloco-outer-step`` with ``topk > 0`` calls :func:`exchange` with each parameter's error buffer
``e = β·e + Δ``; ``demo-exchange`` with each parameter's momentum and the DCT matrix as ``basis``. Each buffer is
flattened and padded with zeros to whole chunks of ``chunk`` elements, one row per chunk (with a basis ``B``, the
row's coefficients ``x Bᵀ``); the rows of every parameter make one ``[R, chunk]`` matrix. Per row,
``torch.topk`` of ``|x|`` picks ``k`` entries, and only they leave the rank, as one message:

- their indices in the row, ``ceil(log2(chunk))`` bits each, packed little-endian into bytes (bit ``j`` of the
  message is bit ``j mod b`` of index ``j div b``; the last byte padded with zero bits);
- their values: 32 bits, the float32 bytes as they are; or ``bits`` in 2, 4, 8, per row scaled by its own
  float32 ``s = max|v|`` (``s = 1`` for a row of zeros), the code ``q = clamp(round((v / s + 1) · L / 2), 0, L)``
  (``L = 2^bits − 1``, round half to even), packed the same way, decoded ``(2q − L) · (s / L)``;
- the rows' scales, float32 (none for 32 bits).

Each part is padded with zero bytes to a multiple of 4, so every rank's float32 parts can be read in place from
the gathered buffer, compiled or not.

What is sent is the decoded value, so the rank subtracts exactly that from its buffer: ``e ← e − ê`` (with a basis,
``e ← e − ĉ B``). The messages are all-gathered; every rank decodes every rank's and adds them with
``scatter_add`` into a zero matrix, rank 0 first, so the sum's order is fixed and the same on every rank (with a
basis, the sum of coefficients then goes back through ``B``, one parameter at a time).
"""

from __future__ import annotations

import math
import operator
import sys

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.program import StepProgram

VALUE_BITS = (2, 4, 8, 32)
aten = torch.ops.aten


def check_options(topk: int, chunk: int, bits: int, who: str) -> None:
    """The exchange's options, as a pass that uses it takes them: ``bits`` one of :data:`VALUE_BITS`, at most a
    chunk's worth of entries sent per chunk. ``who`` names what sends (``SparseLoCo``, ``DeMo``)."""
    if bits not in VALUE_BITS:
        raise ConfigurationError(f"value_bits={bits}: {who} sends values of 2, 4, 8 or 32 bits.")
    if topk > chunk:
        raise ConfigurationError(f"topk={topk} of a chunk of {chunk} elements: give topk <= chunk.")


def index_bits(chunk: int) -> int:
    """Bits of one index into a chunk of ``chunk`` elements (at least 1)."""
    return max(1, math.ceil(math.log2(chunk)))


def message_bytes(rows: int, k: int, chunk: int, bits: int) -> tuple[int, int, int]:
    """Bytes of the indices, the values and the scales of one rank's message for ``rows`` chunks, each part
    padded with zero bytes to a multiple of 4 (so the float32 parts are read in place, compiled or not)."""
    count = rows * k
    indices = _aligned(math.ceil(count * index_bits(chunk) / 8))
    values = 4 * count if bits == 32 else _aligned(math.ceil(count * bits / 8))
    return indices, values, 0 if bits == 32 else 4 * rows


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


def quantise(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``[R, k]`` float32 values: the codes (int64) and the scales ``[R, 1]`` (module doc)."""
    levels = 2**bits - 1
    scale = values.abs().amax(1, keepdim=True)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((values / scale + 1) * (levels / 2)).clamp(0, levels).to(torch.int64)
    return codes, scale


def dequantise(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """``(2q − L) · (s / L)`` in float32."""
    levels = 2**bits - 1
    return (2 * codes - levels).to(torch.float32) * (scale / levels)


def select(rows: torch.Tensor, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's ``[R, chunk]`` buffer: its message (uint8, 1-D) and what the message decodes to, dense
    ``[R, chunk]`` (zero where nothing was sent)."""
    index = torch.topk(rows.abs(), k, dim=1).indices
    values = torch.gather(rows, 1, index)
    if bits == 32:
        sent, parts = values, [values.reshape(-1).view(torch.uint8)]
    else:
        codes, scale = quantise(values, bits)
        sent = dequantise(codes, scale, bits)
        parts = [_padded(pack_bits(codes, bits)), scale.reshape(-1).view(torch.uint8)]
    message = torch.cat([_padded(pack_bits(index, index_bits(rows.shape[1]))), *parts])
    return message, torch.zeros_like(rows).scatter(1, index, sent)


def decode_sum(received: torch.Tensor, rows: int, k: int, chunk: int, bits: int) -> torch.Tensor:
    """Every rank's message (``[W, message bytes]``) decoded and added into a zero ``[rows, chunk]`` float32
    matrix in rank order."""
    index_bytes, value_bytes, _ = message_bytes(rows, k, chunk, bits)
    total = torch.zeros(rows, chunk, dtype=torch.float32, device=received.device)
    for message in received:
        index = unpack_bits(message[:index_bytes], index_bits(chunk), rows * k).reshape(rows, k)
        body = message[index_bytes:]
        if bits == 32:
            values = body.view(torch.float32).reshape(rows, k)
        else:
            codes = unpack_bits(body[:value_bytes], bits, rows * k).reshape(rows, k)
            scale = body[value_bytes:].view(torch.float32).reshape(rows, 1)
            values = dequantise(codes, scale, bits)
        total = total.scatter_add(1, index, values)
    return total


def as_rows(cursor: Cursor, node: fx.Node, chunk: int, comm: dict) -> fx.Node:
    """A tensor flattened and padded with zeros to whole chunks: ``[rows, chunk]``."""
    n = node.meta["val"].numel()
    flat = cursor.emit(aten.reshape.default, (node, [-1]), **comm)
    if n % chunk:
        flat = cursor.emit(aten.constant_pad_nd.default, (flat, [0, chunk - n % chunk]), **comm)
    return cursor.emit(aten.view.default, (flat, [-1, chunk]), **comm)


def unpadded(cursor: Cursor, rows: fx.Node, like: fx.Node, comm: dict) -> fx.Node:
    """Rows that :func:`as_rows` made of ``like`` (or computed from them), back in its shape."""
    val = like.meta["val"]
    flat = cursor.emit(aten.reshape.default, (rows, [-1]), **comm)
    flat = cursor.emit(aten.slice.Tensor, (flat, 0, 0, val.numel()), **comm)
    return cursor.emit(aten.view.default, (flat, list(val.shape)), **comm)


def exchange(
    program: StepProgram,
    cursor: Cursor,
    buffers: dict[str, fx.Node],
    k: int,
    chunk: int,
    bits: int,
    basis: fx.Node | None = None,
    info: dict | None = None,
) -> tuple[dict[str, fx.Node], dict[str, fx.Node]]:
    """Send the top-k of every chunk of the buffers ``buffers`` (by parameter); returns the sum over ranks and the
    buffer left on this rank (``e − ê``), each by parameter in the parameter's shape. With ``basis`` (an
    orthonormal ``[chunk, chunk]`` matrix ``B``, DeMo's DCT) the top-k is taken of each chunk's coefficients
    ``x Bᵀ``; what was sent is taken out as ``ĉ B``, and the sum of the coefficients comes back as ``(Σ ĉ) B``."""
    comm = {"role": "communication"}
    rows = {name: as_rows(cursor, node, chunk, comm) for name, node in buffers.items()}
    coefficients = list(rows.values())
    if basis is not None:  # per parameter, so each product is the same whatever the other parameters are
        transposed = cursor.emit(aten.t.default, (basis,), **comm)
        coefficients = [cursor.emit(aten.mm.default, (r, transposed), **comm) for r in coefficients]
    matrix = coefficients[0] if len(coefficients) == 1 else cursor.emit(aten.cat.default, (coefficients,), **comm)
    count = matrix.meta["val"].shape[0]
    chosen = cursor.emit(select, (matrix, k, bits), **comm)
    message = cursor.emit(operator.getitem, (chosen, 0), **comm, sent=True)  # all that leaves the rank
    sent = cursor.emit(operator.getitem, (chosen, 1), **comm)
    size = message.meta["val"].numel()
    world, group = program.world_size, program.group_name
    info = (info or {"kind": "pseudo-gradients", "pseudo-gradients": tuple(buffers)}) | {
        "topk": k,
        "chunk": chunk,
        "value_bits": bits,
        "bytes": size,
    }
    gathered = cursor.emit(C10D.all_gather_into_tensor.default, (message, world, group), collective=info, **comm)
    received = cursor.emit(aten.view.default, (cursor.emit(WAIT, (gathered,), **comm), [world, size]), **comm)
    total = cursor.emit(decode_sum, (received, count, k, chunk, bits), **comm)
    sums, kept, start = {}, {}, 0
    for name, node in buffers.items():
        end = start + rows[name].meta["val"].shape[0]
        mine, all_ = (cursor.emit(aten.slice.Tensor, (t, 0, start, end), **comm) for t in (sent, total))
        if basis is not None:
            mine, all_ = (cursor.emit(aten.mm.default, (t, basis), **comm) for t in (mine, all_))
        kept[name] = unpadded(cursor, cursor.emit(aten.sub.Tensor, (rows[name], mine), **comm), node, comm)
        sums[name] = unpadded(cursor, all_, node, comm)
        start = end
    return sums, kept
