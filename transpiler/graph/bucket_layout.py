"""Bucket buffers as the graph holds them: the ``transpiler::bucket_ready`` op, the slot layout, and its check.

``fuse-allreduce`` (``passes/bucket_views.py``) writes a bucket's gradients straight into views of one
persistent buffer. Every view starts on a :data:`SLOT_ALIGN_BYTES` boundary, as a tensor of its own would.
MKL's ``gemm`` takes other code paths for an output that is not 16-byte aligned, and on an AVX2-only CPU those
round differently from eager's ``mm`` into a fresh (64-byte aligned) tensor: 7.45e-9 on a 12-24-5 MLP
(issue 16). Aligned, ``mm.out`` into a view gives eager's bits. The few bytes of padding stay zero: nothing
writes them, and their sum over ranks is zero. ``transpiler::bucket_ready`` takes the buffer and every write
and returns the buffer: it orders the all-reduce after the writes by a data dependency.
:func:`check_bucket_views` verifies the layout (a default verifier); ``runtime/compile.py`` turns it back
into the functional ``cat`` that Inductor takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import VerificationError

from .program import StepProgram
from .views import flat_range, is_view

aten = torch.ops.aten
OUT_FORMS = {aten.mm.default: aten.mm.out, aten.sum.dim_IntList: aten.sum.IntList_out}
SLOT_VIEWS = frozenset({aten.as_strided.default, aten.slice.Tensor})  # how a bucket buffer's slots are viewed
PADDING_FILL = frozenset({aten.index_fill_.int_Scalar})  # how a bucket allocated each step zeroes its padding
# At least the CPU allocator's 64 bytes (what eager's outputs get) and cuBLASLt's largest alignment preference.
SLOT_ALIGN_BYTES = 256
FLAT_GRADS = "flat_grads"  # the meta key of a node that holds a bucket's reduced gradients, flat
WHOLE_SHAPE = "whole_shape"  # the meta key of a parameter input held as this rank's slice (ZeRO-3): its whole shape


@dataclass(frozen=True)
class FlatGrads:
    """What ``meta[FLAT_GRADS]`` says of a 1-D node: it holds the reduced gradients of a bucket laid out as
    ``names`` at ``starts`` (``sizes`` elements each) in ``length`` elements, from the bucket's element ``offset``
    on: all of the bucket (``fuse-allreduce``), or this rank's shard of it (``shard-optimizer``)."""

    tag: str  # names the bucket: "grads3"
    names: tuple[str, ...]
    starts: tuple[int, ...]  # where each gradient starts in the bucket
    sizes: tuple[int, ...]  # each gradient's elements (its parameter's)
    length: int  # the bucket's elements, its padding included
    offset: int = 0  # the bucket element that the node's first element is

    def held(self, index: int, numel: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of gradient ``index`` that a node of ``numel`` elements holds (``lo == hi``
        when none)."""
        start, size = self.starts[index], self.sizes[index]
        lo = min(max(self.offset - start, 0), size)
        return lo, max(min(self.offset + numel - start, size), lo)


_lib = torch.library.Library("transpiler", "FRAGMENT")
_lib.define("bucket_ready(Tensor(a) buffer, Tensor[] written) -> Tensor(a)")


@torch.library.impl(_lib, "bucket_ready", "CompositeExplicitAutograd")
def _bucket_ready(buffer: torch.Tensor, written: list[torch.Tensor]) -> torch.Tensor:
    return aten.alias.default(buffer)


BUCKET_READY = torch.ops.transpiler.bucket_ready.default


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


def padded_length(end: int, itemsize: int, shards: int) -> int:
    """The length of a bucket buffer whose slots end at ``end``, cut into ``shards`` equal shards that each
    start on a :data:`SLOT_ALIGN_BYTES` boundary (so a shard's slices start where eager's tensors would)."""
    unit = max(SLOT_ALIGN_BYTES // itemsize, 1) * shards
    return -(-end // unit) * unit if shards > 1 else end


def slot_span(write: fx.Node, buffer: fx.Node) -> tuple[int, int] | None:
    """The element range of ``buffer`` that a write fills (``copy_``'s destination, or the ``out=`` of the
    producer under views), or None when it does not write into a contiguous view of that buffer."""
    if write.target is aten.copy_.default:
        slot = write.args[0]
    else:
        node = write
        while is_view(node):
            node = node.args[0]
        slot = node.kwargs.get("out")
    ranged = flat_range(slot) if isinstance(slot, fx.Node) and slot is not buffer else None
    return ranged[1:] if ranged is not None and ranged[0] is buffer else None


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
        length = padded_length(offset, itemsize, ready.meta.get("shards", 1))
        if length != buffer.meta["val"].numel():
            raise VerificationError(
                f"{where}: its writes fill {offset} of {buffer.meta['val'].numel()} elements, expected {length} "
                "with the padding of its shards."
            )
        strangers = [u.name for u in buffer.users if u is not ready and u.target not in SLOT_VIEWS | PADDING_FILL]
        if strangers:
            raise VerificationError(f"{where} is read by {strangers[:3]}, which are not its views.")
        reduce = next((u for u in ready.users if u.meta.get("collective")), None)
        for name in reduce.meta.get("collective", {}).get("grads", ()) if reduce is not None else ():
            if name in owner:
                raise VerificationError(f"the gradient of '{name}' is in {owner[name]} and in {where}.")
            owner[name] = where
