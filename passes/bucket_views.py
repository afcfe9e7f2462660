"""Persistent bucket buffers: gradients written straight into views of one buffer per bucket.

Not a pass: ``fuse-allreduce`` lays a bucket out through :func:`write_into_buffer` when its option
``gradient-as-bucket-view`` is on (the default; DDP's option of that name). The buffer is a constant of
the program, allocated once (zeroed) and reused every step (never saved in checkpoints), so no step
allocates a fresh bucket (``cat``) and the reduced gradients are views of it, with no copy back.

Every view starts on a :data:`SLOT_ALIGN_BYTES` boundary, as a tensor of its own would. MKL's ``gemm``
takes other code paths for an output that is not 16-byte aligned, and on an AVX2-only CPU those round
differently from eager's ``mm`` into a fresh (64-byte aligned) tensor: 7.45e-9 on a 12-24-5 MLP (issue 16).
Aligned, ``mm.out`` into a view gives eager's bits. The few bytes of padding stay zero: nothing writes
them, and their sum over ranks is zero. A gradient whose
producer has an ``out=`` form (``mm`` for weight gradients, ``sum`` for bias gradients) and which nothing
else reads is *produced* into its view; any other gradient is copied into it (``copy_``), as DDP copies
gradients into its buckets. ``transpiler::bucket_ready`` takes the buffer and every write and returns the
buffer: it orders the all-reduce after the writes by a data dependency, as every other order in the graph
is kept. ``check_bucket_views`` verifies the layout; ``transpiler/compile.py`` turns it back into the
functional ``cat`` that Inductor takes (Inductor plans its own buffers).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transpiler.errors import VerificationError
from transpiler.graph_edit import Cursor, emit
from transpiler.program import StepProgram

from .gradient_flow import add_constant, reads_raw_gradient

aten = torch.ops.aten
OUT_FORMS = {aten.mm.default: aten.mm.out, aten.sum.dim_IntList: aten.sum.IntList_out}
# At least the CPU allocator's 64 bytes (what eager's outputs get) and cuBLASLt's largest alignment preference.
SLOT_ALIGN_BYTES = 256
_lib = torch.library.Library("transpiler", "FRAGMENT")
_lib.define("bucket_ready(Tensor(a) buffer, Tensor[] written) -> Tensor(a)")


@torch.library.impl(_lib, "bucket_ready", "CompositeExplicitAutograd")
def _bucket_ready(buffer: torch.Tensor, written: list[torch.Tensor]) -> torch.Tensor:
    return aten.alias.default(buffer)


BUCKET_READY = torch.ops.transpiler.bucket_ready.default


def is_view(node: fx.Node) -> bool:
    """An aten op whose result is a view of its first argument (``view``, ``t``, ``slice``...)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


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


def aligned(offset: int, itemsize: int) -> int:
    """The first element offset at or after ``offset`` that lies on a :data:`SLOT_ALIGN_BYTES` boundary."""
    step = max(SLOT_ALIGN_BYTES // itemsize, 1)
    return -(-offset // step) * step


def slot_offsets(sizes: list[int], itemsize: int) -> list[int]:
    """Where each of ``sizes`` elements starts in a bucket buffer: packed in order, each start aligned."""
    starts, end = [], 0
    for n in sizes:
        starts.append(aligned(end, itemsize))
        end = starts[-1] + n
    return starts


def write_into_buffer(
    program: StepProgram, nodes: list[fx.Node], tag: str, index: int, cursor: Cursor
) -> tuple[fx.Node, list[int]]:
    """Lay ``nodes`` out in a persistent buffer, in order, copies emitted at ``cursor``. Returns the buffer
    once all are in, and the offset each node starts at."""
    first = nodes[0].meta["val"]
    sizes = [n.meta["val"].numel() for n in nodes]
    starts = slot_offsets(sizes, first.element_size())
    comm = {"role": "communication", "bucket": (tag, index)}
    buffer = add_constant(
        program,
        _slot_name(program, tag, index),
        torch.zeros(starts[-1] + sizes[-1], dtype=first.dtype, device=first.device),
        bucket=comm["bucket"],
    )
    slots, at = [], Cursor(program.graph, buffer)
    for node, start, n in zip(nodes, starts, sizes):
        piece = at.emit(aten.slice.Tensor, (buffer, 0, start, start + n), **comm)
        slots.append(at.emit(aten.view.default, (piece, list(node.meta["val"].shape)), **comm))
    writes = []
    for node, slot in zip(nodes, slots):
        producer = _producer(node)
        if producer is None:
            writes.append(cursor.emit(aten.copy_.default, (slot, node), **comm))
            continue
        shape = list(producer.meta["val"].shape)  # sum(keepdim=True) is [1, n] where the gradient is [n]
        if shape != list(node.meta["val"].shape):
            with program.graph.inserting_after(slot):
                slot = emit(program.graph, aten.view.default, (slot, shape), **comm)
        producer.target = OUT_FORMS[producer.target]
        producer.kwargs = {**producer.kwargs, "out": slot}
        writes.append(node)
    return cursor.emit(BUCKET_READY, (buffer, writes), **comm), starts


def slot_span(write: fx.Node, buffer: fx.Node) -> tuple[int, int] | None:
    """The element range of ``buffer`` that a write fills (``copy_``'s destination, or the ``out=`` of the
    producer under views), or None when it does not write into a slice of that buffer."""
    if write.target is aten.copy_.default:
        slot = write.args[0]
    else:
        node = write
        while is_view(node):
            node = node.args[0]
        slot = node.kwargs.get("out")
    while slot is not None and slot.target is aten.view.default:
        slot = slot.args[0]
    if slot is None or slot.target is not aten.slice.Tensor or slot.args[0] is not buffer:
        return None
    return slot.args[2], slot.args[3]


def check_bucket_views(program: StepProgram, final: bool) -> None:
    """Every bucket buffer is filled exactly: its writes fill disjoint views that cover it in order, each
    starting at the first aligned offset after the last (the gaps are padding), nothing else touches it,
    and no gradient lives in two buckets."""
    owner: dict[str, str] = {}
    for ready in (n for n in program.graph.nodes if n.op == "call_function" and n.target is BUCKET_READY):
        buffer, writes = ready.args
        where = f"bucket buffer '{buffer.name}'"
        offset = 0
        itemsize = buffer.meta["val"].element_size()
        for write in writes:
            span = slot_span(write, buffer)
            if span is None:
                raise VerificationError(f"{where}: '{write.name}' is not written into a view of it.")
            start, end = span
            if start != aligned(offset, itemsize) or end - start != write.meta["val"].numel():
                expected = aligned(offset, itemsize)
                raise VerificationError(f"{where}: '{write.name}' fills [{start}, {end}), expected it at {expected}.")
            offset = end
        if offset != buffer.meta["val"].numel():
            raise VerificationError(f"{where}: its writes fill {offset} of {buffer.meta['val'].numel()} elements.")
        strangers = [u.name for u in buffer.users if u is not ready and u.target is not aten.slice.Tensor]
        if strangers:
            raise VerificationError(f"{where} is read by {strangers[:3]}, which are not its views.")
        reduce = next(iter(ready.users), None)
        for name in reduce.meta.get("collective", {}).get("grads", ()) if reduce is not None else ():
            if name in owner:
                raise VerificationError(f"the gradient of '{name}' is in {owner[name]} and in {where}.")
            owner[name] = where
