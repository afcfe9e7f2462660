"""The exchange of one Streaming DiLoCo fragment's pseudo-gradients, started in one program and finished in a
later one, in full or low precision, always summed in float32.

Not a pass. ``diloco-outer-step`` starts an exchange with :func:`start` (the fragment's Δs in one flat float32
buffer; what :func:`start` returns is carried to a later step unwaited), goes on with :func:`reduce` (a
low-precision exchange's second collective, issued in the later step as soon as its forward ends) and ends it with
:func:`finish`, which returns the sum over ranks. The wire formats (``exchange``):

- ``float32``: one sum all-reduce of the buffer.
- ``bfloat16``, ``float8_e4m3fn``, ``int4``: the buffer, padded to ``W`` equal chunks of whole blocks, is
  encoded, and an all-to-all gives each rank its chunk from every rank (a reduce-scatter's traffic). That rank
  decodes them and sums them in float32, encodes its summed chunk, and an all-gather gives every rank every
  summed chunk, which it decodes. So the values are rounded twice (each rank's Δ, then the sum), and the sum
  itself is exact float32 arithmetic, as torchft's quantised all-reduce does it.

Encodings, per row of the ``[W, chunk]`` buffer, in blocks of :data:`BLOCK` elements: ``bfloat16`` is the values
rounded to bfloat16 (2 bytes each, no scale). ``float8_e4m3fn`` and ``int4`` scale each block by its own float32
``s = max|x| / Q`` (``Q`` 448 and 7; a block of zeros gets ``s = 1``): ``float8_e4m3fn`` stores ``x / s`` rounded to
float8 e4m3 (1 byte); ``int4`` stores ``round(x / s)`` (half to even, in ``[-7, 7]``) plus 8 as a nibble, two per
byte, the even element in the low nibble, and decodes ``(nibble - 8) * s``. A row is its values' bytes, then its
blocks' scales (float32, native byte order): 4.5 bits per element for ``int4``, 8.5 for ``float8_e4m3fn``.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.program import StepProgram

BLOCK = 64  # elements per scale block
SCALED = {"float8_e4m3fn": 448.0, "int4": 7.0}  # the largest code of each scaled format
EXCHANGES = ("float32", "bfloat16", "float8_e4m3fn", "int4")
aten = torch.ops.aten


def padded_length(length: int, world: int, exchange: str) -> int:
    """The buffer's length on the wire: ``W`` chunks of whole blocks (float32: the length itself)."""
    if exchange == "float32":
        return length
    unit = world * BLOCK
    return math.ceil(length / unit) * unit


def row_bytes(chunk: int, exchange: str) -> int:
    """Bytes of one encoded row of ``chunk`` elements."""
    if exchange == "bfloat16":
        return 2 * chunk
    scales = 4 * (chunk // BLOCK)
    return (chunk if exchange == "float8_e4m3fn" else chunk // 2) + scales


def carried_like(length: int, world: int, exchange: str) -> tuple[int, torch.dtype]:
    """Shape (1-D) and dtype of what :func:`start` leaves in flight."""
    if exchange == "float32":
        return length, torch.float32
    return world * row_bytes(padded_length(length, world, exchange) // world, exchange), torch.uint8


def encode(rows: torch.Tensor, exchange: str) -> torch.Tensor:
    """``[R, chunk]`` float32 to ``[R, row_bytes]`` uint8 (the module docstring's encodings)."""
    r, chunk = rows.shape
    if exchange == "bfloat16":
        return rows.to(torch.bfloat16).view(torch.uint8)
    blocks = rows.reshape(r, chunk // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / SCALED[exchange]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = blocks / scale
    if exchange == "float8_e4m3fn":
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(r, chunk)
    else:
        nibbles = (torch.round(scaled).clamp(-7, 7) + 8).to(torch.uint8).reshape(r, chunk)
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return torch.cat([codes, scale.reshape(r, chunk // BLOCK).contiguous().view(torch.uint8)], 1)


def decode(data: torch.Tensor, exchange: str, chunk: int) -> torch.Tensor:
    """``[R, row_bytes]`` uint8 back to ``[R, chunk]`` float32."""
    r = data.shape[0]
    if exchange == "bfloat16":
        return data.contiguous().view(torch.bfloat16).to(torch.float32)
    code_bytes = chunk if exchange == "float8_e4m3fn" else chunk // 2
    codes, scale = data[:, :code_bytes], data[:, code_bytes:].contiguous().view(torch.float32)
    if exchange == "float8_e4m3fn":
        values = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    else:
        low, high = (codes & 15).to(torch.float32) - 8, (codes >> 4).to(torch.float32) - 8
        values = torch.stack([low, high], -1).reshape(r, chunk)
    return (values.reshape(r, chunk // BLOCK, BLOCK) * scale.reshape(r, chunk // BLOCK, 1)).reshape(r, chunk)


def start(program: StepProgram, cursor: Cursor, flat: fx.Node, exchange: str, info: dict) -> fx.Node:
    """Issue the exchange of ``flat`` (1-D float32); returns the collective's result, which nothing waits here."""
    world, group = program.world_size, program.group_name
    comm = {"role": "communication"}
    if exchange == "float32":
        return cursor.emit(C10D.all_reduce.default, (flat, "sum", group), collective=info, **comm)
    length = flat.meta["val"].numel()
    padded = padded_length(length, world, exchange)
    if padded != length:
        flat = cursor.emit(aten.constant_pad_nd.default, (flat, [0, padded - length]), **comm)
    rows = cursor.emit(aten.view.default, (flat, [world, padded // world]), **comm)
    encoded = cursor.emit(encode, (rows, exchange), **comm)
    wire = cursor.emit(aten.view.default, (encoded, [-1]), **comm)
    sizes = [row_bytes(padded // world, exchange)] * world
    return cursor.emit(C10D.all_to_all_single.default, (wire, sizes, sizes, group), collective=info, **comm)


def reduce(program: StepProgram, cursor: Cursor, carried: fx.Node, length: int, exchange: str, info: dict) -> fx.Node:
    """The second half of a low-precision exchange: wait for the all-to-all :func:`start` issued (``carried``), sum
    this rank's chunk and issue the all-gather of the sums; returns it unwaited (float32: ``carried`` as it is,
    its all-reduce already sums). Emitted where the step's forward ends when the exchange was started by an
    earlier step, so that the all-to-all has the forward to finish in and the all-gather the backward."""
    if exchange == "float32":
        return carried
    comm = {"role": "communication", "pinned": True}  # schedule-collectives leaves it where it is emitted
    world, group = program.world_size, program.group_name
    chunk = padded_length(length, world, exchange) // world
    waited = cursor.emit(WAIT, (carried,), **comm)
    received = cursor.emit(aten.view.default, (waited, [world, row_bytes(chunk, exchange)]), **comm)
    mine = cursor.emit(aten.sum.dim_IntList, (cursor.emit(decode, (received, exchange, chunk), **comm), [0]), **comm)
    summed = cursor.emit(encode, (cursor.emit(aten.view.default, (mine, [1, chunk]), **comm), exchange), **comm)
    flat = cursor.emit(aten.view.default, (summed, [-1]), **comm)
    gather = C10D.all_gather_into_tensor.default
    return cursor.emit(gather, (flat, world, group), collective=info, in_flight_alone=True, **comm)


def finish(program: StepProgram, cursor: Cursor, reduced: fx.Node, length: int, exchange: str) -> fx.Node:
    """Wait for what :func:`reduce` issued and return the float32 sum over ranks, 1-D."""
    comm = {"role": "communication"}
    waited = cursor.emit(WAIT, (reduced,), **comm)
    if exchange == "float32":
        return waited
    world = program.world_size
    chunk = padded_length(length, world, exchange) // world
    rows = cursor.emit(aten.view.default, (waited, [world, -1]), **comm)
    values = cursor.emit(aten.view.default, (cursor.emit(decode, (rows, exchange, chunk), **comm), [-1]), **comm)
    return cursor.emit(aten.slice.Tensor, (values, 0, 0, length), **comm)
