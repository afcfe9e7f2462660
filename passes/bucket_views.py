"""Persistent bucket buffers: gradients written straight into views of one buffer per bucket.

Not a pass: ``fuse-allreduce`` lays a bucket out through :func:`write_into_buffer` when its option
``gradient-as-bucket-view`` is on (the default; DDP's option of that name). The buffer is a constant of
the program, allocated once (zeroed) and reused every step (never saved in checkpoints), so no step
allocates a fresh bucket (``cat``) and the reduced gradients are views of it, with no copy back.

The slots are laid out as ``transpiler/graph/bucket_layout.py`` says (each on an aligned start, so that
``mm.out`` into a view carries eager's bits), which its verifier checks. A gradient whose
producer has an ``out=`` form (``mm`` for weight gradients, ``sum`` for bias gradients) and which nothing
else reads is *produced* into its view; any other gradient is copied into it (``copy_``), as DDP copies
gradients into its buckets. ``transpiler::bucket_ready`` then orders the all-reduce after the writes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transpiler.graph.bucket_layout import BUCKET_READY, OUT_FORMS, padded_length, slot_offsets
from transpiler.graph.edit import Cursor, emit, position
from transpiler.graph.program import StepProgram
from transpiler.graph.views import contiguous_strides, is_view

from .gradient_flow import add_constant, reads_raw_gradient

aten = torch.ops.aten


def aliased_to_output(grad: fx.Node) -> bool:
    """Whether a reader of ``grad`` (other than the raw readers that keep the unreduced value) passes it, or a
    view of it, out of the graph: then it cannot live in a buffer the next step overwrites."""
    stack = [u for u in grad.users if not reads_raw_gradient(u)]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "output":
            return True
        if is_view(node) or node.target is operator.getitem:
            stack.extend(node.users)
    return False


def _producer(grad: fx.Node) -> fx.Node | None:
    """The op that computes ``grad`` through views only, when it can write into the bucket instead: it has an
    ``out=`` form, every node between it and ``grad`` has one reader, both are contiguous, and nothing but
    the readers ``replace_gradient`` moves to the reduced value reads ``grad``."""
    if any(reads_raw_gradient(u) for u in grad.users):
        return None
    node = grad
    while is_view(node):
        node = node.args[0]
        if len(node.users) != 1:
            return None
    if node.op != "call_function" or node.target not in OUT_FORMS or "out" in node.kwargs:
        return None
    values = (node.meta.get("val"), grad.meta.get("val"))
    if not all(isinstance(v, torch.Tensor) and v.is_contiguous() for v in values):
        return None
    return node


def _slot_name(program: StepProgram, tag: str, index: int) -> str:
    name, n = f"bucket_{tag}_{index}", 1
    while hasattr(program.graph_module, name):
        name, n = f"bucket_{tag}_{index}_{n}", n + 1
    return name


def _gaps(starts: list[int], sizes: list[int], length: int) -> list[tuple[int, int]]:
    """The element ranges of a bucket buffer that no slot covers: alignment padding and the shards' tail."""
    ends = [start + n for start, n in zip(starts, sizes)]
    spans = zip([0, *ends], [*starts, length])
    return [(lo, hi) for lo, hi in spans if hi > lo]


def write_into_buffer(
    program: StepProgram,
    nodes: list[fx.Node],
    tag: str,
    index: int,
    cursor: Cursor,
    shards: int = 1,
    persistent: bool = True,
) -> tuple[fx.Node, list[int]]:
    """Lay ``nodes`` out in one bucket buffer, in order, copies emitted at ``cursor``. Returns the buffer
    once all are in, and the offset each node starts at. With ``shards`` the buffer is padded at its end
    to that many equal, aligned shards (``padded_length``), for a reduce-scatter. A ``persistent`` buffer is a
    constant of the program (zeroed once); otherwise each step allocates it right before the first write, zeroes
    its padding, and frees it after its last reader (ZeRO-2: no gradient memory between steps, no packing copy)."""
    first = nodes[0].meta["val"]
    sizes = [n.meta["val"].numel() for n in nodes]
    starts = slot_offsets(sizes, first.element_size())
    length = padded_length(starts[-1] + sizes[-1], first.element_size(), shards)
    comm = {"role": "communication", "bucket": (tag, index)}
    producers = [_producer(node) for node in nodes]
    if persistent:
        zeros = torch.zeros(length, dtype=first.dtype, device=first.device)
        buffer = add_constant(program, _slot_name(program, tag, index), zeros, bucket=comm["bucket"])
    else:
        order = position(program.graph)
        earliest = min((p if p is not None else n for p, n in zip(producers, nodes)), key=order.__getitem__)
        with program.graph.inserting_before(earliest):
            factory = {"dtype": first.dtype, "device": first.device, "pin_memory": False}
            buffer = emit(program.graph, aten.empty.memory_format, ([length],), factory, **comm)
    slots, at = [], Cursor(program.graph, buffer)
    gaps = _gaps(starts, sizes, length)
    if not persistent and gaps:  # only the padding is zeroed, in one op: the writes fill the rest
        where = torch.cat([torch.arange(lo, hi) for lo, hi in gaps]).to(first.device)
        padding = add_constant(program, _slot_name(program, f"{tag}_padding", index), where, padding_of=comm["bucket"])
        at.emit(aten.index_fill_.int_Scalar, (buffer, 0, padding, 0), **comm)
    for node, start, producer in zip(nodes, starts, producers):
        # one view op per slot, in the shape it is written in (sum(keepdim=True) is [1, n] where the gradient is [n])
        shape = list((producer or node).meta["val"].shape)
        slots.append(at.emit(aten.as_strided.default, (buffer, shape, contiguous_strides(shape), start), **comm))
    writes = []
    for node, slot, producer in zip(nodes, slots, producers):
        if producer is None:
            writes.append(cursor.emit(aten.copy_.default, (slot, node), **comm))
            continue
        producer.target = OUT_FORMS[producer.target]
        producer.kwargs = {**producer.kwargs, "out": slot}
        writes.append(node)
    ready = cursor.emit(BUCKET_READY, (buffer, writes), **comm)
    if shards > 1:
        ready.meta["shards"] = shards
    return ready, starts
