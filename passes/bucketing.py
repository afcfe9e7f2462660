"""Shared by the reducing passes: assign buckets, emit bucketed all-reduces.

Not a pass: ``allreduce-grads`` (one gradient per bucket), ``fuse-allreduce``
and ``local-sgd-average`` all reduce through :func:`reduce_in_buckets`, so
there is one way a value gets all-reduced.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.bucket_layout import FLAT_GRADS, FlatGrads
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor, node_bytes, position
from transpiler.graph.options import option
from transpiler.graph.pipeline import ReducingPass
from transpiler.graph.program import StepProgram

from .bucket_views import aliased_to_output, write_into_buffer
from .gradient_flow import unreduced_gradients

DEFAULT_CAP_MB = 25.0  # DDP's bucket_cap_mb


def bucket_cap_option(*words: tuple[str, str]) -> float:
    """The ``bucket-cap-mb`` field of a bucketing pass (DDP's default cap); each of ``words`` is a ``(word,
    meaning)`` pair naming a value that the pass chooses itself (``auto``, ``layer``, ``cost``), which the help
    explains."""
    return option(
        DEFAULT_CAP_MB,
        minimum=0,
        words=tuple((word, word) for word, _ in words),
        help="bucket size cap in MiB; 0 puts each gradient in its own bucket"
        + "".join(f"; {word}: {meaning}" for word, meaning in words),
    )


def first_bucket_option() -> float:
    """The ``first-bucket-mb`` field of a bucketing pass (DDP's smaller first bucket)."""
    return option(1.0, minimum=0, help="cap in MiB of the first bucket, issued earliest")


def wire_dtype_option() -> str:
    """The ``wire_dtype`` field of a reducing pass: the wire format of its all-reduces."""
    return option("none", choices=tuple(WIRE), help="all-reduce in half precision (SINGA fp16, DDP fp16/bf16 hooks)")


def across_option(what: str) -> bool:
    """The ``across`` field of a reducing pass: after its reduction, sum ``what`` over axis ``across`` too."""
    return option(
        False,
        help=f"then sum {what} over axis 'across' (the ranks of its place in the other replica groups of a torchft "
        "quorum: HSDP's layout)",
    )


def sum_across(program: StepProgram, cursor: Cursor, reduced: fx.Node, bucket: int, comm: dict) -> fx.Node:
    """``reduced`` (a value this rank's group has just reduced, ours alone) summed in place over axis ``across``:
    the same value of every other replica group, which cut their buckets alike."""
    across = program.axes.get("across")
    if across is None:
        raise ConfigurationError(
            "a pass with across=true sums over axis 'across', and this program has none: it runs under "
            "transpile(fault_tolerance=...), whose replica groups declare it."
        )
    value = reduced.meta["val"]
    summed = {"kind": "all_reduce", "bucket": bucket, "axis": "across", "bytes": value.numel() * value.element_size()}
    done = cursor.emit(C10D.all_reduce_.default, (reduced, "sum", across.group_name), collective=summed, **comm)
    return cursor.emit(WAIT, (done,), **comm)


WIRE: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
MB = 1024 * 1024
aten = torch.ops.aten


def in_group_order(program: StepProgram, names: list[str]) -> list[int]:
    """The indices of ``names`` (a bucket's members, in production order) sorted by optimizer param group, stably:
    a bucket lays out each group's parameters next to each other, so one update op can serve each group's run
    (``flatten-update``). The order of slots changes no value that is reduced."""
    return sorted(range(len(names)), key=lambda i: program.param_groups.get(names[i], 0))


def bucket_key(node: fx.Node) -> tuple[str, str]:
    val = node.meta["val"]
    return str(val.dtype), str(val.device)


def caps_in_bytes(bucket_cap_mb: float, first_bucket_mb: float) -> tuple[int, int]:
    """A bucketing pass's two caps (its ``bucket-cap-mb`` and ``first-bucket-mb`` fields) in bytes."""
    return int(bucket_cap_mb * MB), int(first_bucket_mb * MB)


def placed_buckets(
    program: StepProgram,
    nodes: list[fx.Node],
    cap: int,
    first_cap: int,
    groups: list[str] | None = None,
    alone_from: float = float("inf"),
) -> Iterator[tuple[int, list[int], Cursor]]:
    """The buckets of ``nodes`` (:func:`assign_buckets` by their bytes, dtype and device, never splitting a run
    of one of ``groups``): each one's index, its members' indices in ``nodes``, and a cursor just after its last
    member in graph order."""
    sizes, keys = [node_bytes(n) for n in nodes], [bucket_key(n) for n in nodes]
    buckets = assign_buckets(sizes, keys, cap, first_cap, groups, alone_from)
    order = position(program.graph)  # computed once, for linear time; new nodes are never members
    for index, members in enumerate(buckets):
        yield index, members, Cursor(program.graph, max((nodes[i] for i in members), key=order.__getitem__))


@dataclass(frozen=True)
class BucketedGradientPass(ReducingPass):
    """A pass that reduces the step's unreduced gradients in buckets of its own (``allgather-grads``,
    ``sparse-allreduce``): the two cap options, and :meth:`reduce`, called when there is a gradient to reduce."""

    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()

    def run(self, program: StepProgram) -> bool:
        grads = unreduced_gradients(program)
        if grads:
            self.reduce(program, grads)
        return bool(grads)

    def reduce(self, program: StepProgram, grads: list[fx.Node]) -> None:
        raise NotImplementedError

    def buckets(
        self, program: StepProgram, nodes: list[fx.Node], groups: list[str] | None = None
    ) -> Iterator[tuple[int, list[int], Cursor]]:
        return placed_buckets(program, nodes, *caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb), groups)


def assign_buckets(
    sizes: list[int],
    keys: list[tuple],
    cap_bytes: int,
    first_cap_bytes: int,
    groups: list[str] | None = None,
    alone_from: float = float("inf"),
) -> list[list[int]]:
    """Partition item indices into buckets, in order, one open bucket per key.

    An item joins its key's open bucket unless that would exceed the cap; the
    first bucket of each key has ``first_cap_bytes``. ``cap_bytes <= 0`` puts
    every item alone. With ``groups`` (say each item's module), a run of items of one group and key is
    never split: the cap is checked when the run starts, against the whole run (a run larger than the cap
    is a bucket of its own), and a run of at least ``alone_from`` bytes starts a bucket, which the smaller runs
    after it join (ZeRO-3's units by cost). Buckets come back ordered by their last item.
    """
    runs = _run_bytes(sizes, keys, groups) if groups is not None else sizes
    open_bucket: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed: dict[tuple, int] = {}
    done: list[list[int]] = []
    for i, (size, key) in enumerate(zip(sizes, keys)):
        if cap_bytes <= 0:
            done.append([i])
            continue
        cap = first_cap_bytes if closed.get(key, 0) == 0 else cap_bytes
        same_run = groups is not None and key in open_bucket and groups[open_bucket[key][-1]] == groups[i]
        if key in open_bucket and not same_run and (open_bytes[key] + runs[i] > cap or runs[i] >= alone_from):
            done.append(open_bucket.pop(key))
            closed[key] = closed.get(key, 0) + 1
        if key not in open_bucket:
            open_bucket[key], open_bytes[key] = [], 0
        open_bucket[key].append(i)
        open_bytes[key] += size
    done.extend(open_bucket.values())
    return sorted(done, key=lambda b: b[-1])


def _run_bytes(sizes: list[int], keys: list[tuple], groups: list[str]) -> list[int]:
    """For each item, the bytes of the run of items of its key and group that it starts (the items of one key
    taken in order); an item inside a run gets the bytes from it to the run's end."""
    out = list(sizes)
    after: dict[tuple, int] = {}  # key -> the next item of that key
    for i in reversed(range(len(sizes))):
        nxt = after.get(keys[i])
        if nxt is not None and groups[nxt] == groups[i]:
            out[i] += out[nxt]
        after[keys[i]] = i
    return out


def reduce_in_buckets(
    program: StepProgram,
    items: list[tuple[str, fx.Node]],
    cap_bytes: int,
    first_cap_bytes: int,
    *,
    tag: str,
    compress: torch.dtype | None = None,
    bucket_views: bool = False,
    across: bool = False,
) -> list[fx.Node]:
    """Sum all-reduce the named values in dtype/size buckets, each bucket right after its last member.

    Returns, in the order of ``items``, the node that holds each reduced value;
    replacing readers is the caller's business. ``tag`` names what is reduced
    (``grads``, ``deltas``...) in ``meta["collective"]``. With ``compress``
    (float16 or bfloat16) each bucket is cast to it, reduced, and cast back:
    callers scale values to their share *before* (no overflow in the sum). With ``bucket_views`` a bucket
    of several uncompressed values is a persistent buffer they are written into (``bucket_views.py``). With
    ``across`` each reduced bucket is then summed over axis ``across`` (:func:`sum_across`), on the wire.
    """
    nodes = [node for _, node in items]
    reduced: dict[fx.Node, fx.Node] = {}
    for index, members, cursor in placed_buckets(program, nodes, cap_bytes, first_cap_bytes):
        chosen = [items[i] for i in members]
        reduced.update(_reduce_bucket(program, chosen, index, cursor, tag, compress, bucket_views, across))
    return [reduced[n] for n in nodes]


def _reduce_bucket(
    program: StepProgram,
    members: list[tuple[str, fx.Node]],
    index: int,
    cursor: Cursor,
    tag: str,
    compress: torch.dtype | None,
    bucket_views: bool,
    across: bool,
) -> dict[fx.Node, fx.Node]:
    members = [members[i] for i in in_group_order(program, [name for name, _ in members])]
    nodes = [node for _, node in members]
    dtype = nodes[0].meta["val"].dtype
    wire = compress if compress is not None and dtype.is_floating_point else dtype
    info = {
        "kind": "all_reduce",
        "bucket": index,
        tag: tuple(n for n, _ in members),
        "bytes": sum(n.meta["val"].numel() for n in nodes) * wire.itemsize,
    }
    if wire != dtype:
        info["compressed"] = str(wire).removeprefix("torch.")
    comm = {"role": "communication", "bucket": (tag, index)}
    starts = None  # packed; a persistent buffer aligns each start
    if len(nodes) == 1 and wire == dtype:
        reduced = cursor.emit(C10D.all_reduce.default, (nodes[0], "sum", program.group_name), collective=info, **comm)
        waited = cursor.emit(WAIT, (reduced,), **comm)
        return {nodes[0]: sum_across(program, cursor, waited, index, comm) if across else waited}
    if len(nodes) == 1:
        flat = nodes[0]
    elif bucket_views and wire == dtype and not any(aliased_to_output(n) for n in nodes):
        flat, starts = write_into_buffer(program, nodes, tag, index, cursor)
        info["padding_bytes"] = flat.args[0].meta["val"].nbytes - info["bytes"]  # aligned slots; sent too
    else:
        pieces = [cursor.emit(aten.reshape.default, (n, [-1]), **comm) for n in nodes]
        flat = cursor.emit(aten.cat.default, (pieces,), **comm)
    if wire != dtype:
        flat = cursor.emit(aten._to_copy.default, (flat,), {"dtype": wire}, **comm)
    # a fused or cast buffer is ours alone, so it is reduced in place (no clone); a lone value is not
    reduced = cursor.emit(C10D.all_reduce_.default, (flat, "sum", program.group_name), collective=info, **comm)
    waited = cursor.emit(WAIT, (reduced,), **comm)
    if across:
        waited = sum_across(program, cursor, waited, index, comm)
    if wire != dtype:
        waited = cursor.emit(aten._to_copy.default, (waited,), {"dtype": dtype}, **comm)
    if len(nodes) == 1:
        return {nodes[0]: waited}
    sizes = tuple(n.meta["val"].numel() for n in nodes)
    starts = starts if starts is not None else [0, *itertools.accumulate(sizes)][:-1]
    names = tuple(name for name, _ in members)
    waited.meta[FLAT_GRADS] = FlatGrads(f"{tag}{index}", names, tuple(starts), sizes, waited.meta["val"].numel())
    return unflatten(cursor, waited, nodes, comm, starts)


def unflatten(
    cursor: Cursor, flat: fx.Node, like: list[fx.Node], meta: dict, starts: list[int] | None = None
) -> dict[fx.Node, fx.Node]:
    """Views of a flat buffer shaped as the ``like`` nodes, in order (the inverse of reshape + cat). With
    ``starts``, each node begins at its offset and the gaps between are padding that no view covers."""
    sizes = [n.meta["val"].numel() for n in like]
    starts = starts if starts is not None else [0, *itertools.accumulate(sizes)][:-1]
    chunks, index, end = [], [], 0
    for start, n in zip(starts, sizes):
        if start > end:
            chunks.append(start - end)
        index.append(len(chunks))
        chunks.append(n)
        end = start + n
    split = cursor.emit(aten.split_with_sizes.default, (flat, chunks), **meta)
    views = {}
    for i, n in zip(index, like):
        piece = cursor.emit(operator.getitem, (split, i), **meta)
        views[n] = cursor.emit(aten.view.default, (piece, list(n.meta["val"].shape)), **meta)
    return views
