"""``transpile(..., compile=True)``: each rewritten step program compiled by ``torch.compile`` (Inductor).

The program is compiled as it is, collectives included: Inductor sees torch's functional collectives
and keeps them, in the order the passes left them. Two things change before compiling, on a copy:
the in-place bucket all-reduces (``all_reduce_``, which functionalization cannot take) become the
out-of-place ``all_reduce``. That is safe because every reader of a reduced bucket reads its wait's
result, never the buffer, and the check below makes sure of it. Each program is compiled with
``fullgraph=True`` and ``dynamic=False``, on its first call: a program that cannot be compiled fails
then, before any of its collectives runs, with a :class:`ConfigurationError` that names it. A new
batch shape is a new program and compiles again.

Every compile runs with the CPU capability ATen dispatches to (``ATEN_CPU_CAPABILITY``) in torch's cache key
(:func:`capability_tag`). Inductor writes its C++ loops for the vector width of that capability, but torch 2.13's
FX graph cache leaves the width out of its key: a process under ``ATEN_CPU_CAPABILITY=avx2`` loaded the step an
AVX-512 process had cached, rebuilt its source for 8 lanes while the loops stepped by 16, and left every other 8
values of each buffer unwritten (NaN parameters, issue 42).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

from transpiler.errors import ConfigurationError
from transpiler.graph.bucket_layout import BUCKET_READY, OUT_FORMS, slot_span
from transpiler.graph.collectives import C10D
from transpiler.graph.edit import position
from transpiler.graph.views import flat_range, is_view

aten = torch.ops.aten
log = logging.getLogger("transpiler")


def functional_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the program whose collectives are all out of place (what torch.compile takes)."""
    graph = copy.deepcopy(gm.graph)
    _functional_buckets(graph)
    order = position(graph)
    for node in graph.nodes:
        if node.target is not C10D.all_reduce_.default:
            continue
        buffer = node.args[0]
        later = [u.name for u in buffer.users if u is not node and order[u] > order[node]]
        if later:
            raise ConfigurationError(
                f"compile=True: {node.name} reduces {buffer.name} in place and {later[:3]} read the buffer "
                "afterwards, so it cannot become an out-of-place all-reduce. Use compile=False."
            )
        node.target = C10D.all_reduce.default
    return fx.GraphModule(gm, graph)


def _functional_buckets(graph: fx.Graph) -> None:
    """Persistent bucket buffers back to the functional form: producers lose ``out=``, copies into the
    buffer go, and the buffer a bucket's writes fill becomes a ``cat`` of them, with zeros where the buffer
    pads a slot to its alignment or itself to W equal shards (Inductor plans buffers)."""
    functional = {out: op for op, out in OUT_FORMS.items()}
    spans = {
        n: [slot_span(w, n.args[0]) for w in n.args[1]]
        for n in graph.nodes
        if n.op == "call_function" and n.target is BUCKET_READY
    }
    for node in list(graph.nodes):
        if node.target in functional and "out" in node.kwargs:
            node.target = functional[node.target]
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        elif node.target is aten.copy_.default and _into_bucket(node.args[0]):
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
        elif node.target is BUCKET_READY:
            with graph.inserting_before(node):
                pieces, end = [], 0
                for write, (start, stop) in zip(node.args[1], spans[node]):
                    if start > end:
                        pieces.append(graph.call_function(aten.new_zeros.default, (write, [start - end])))
                    pieces.append(graph.call_function(aten.reshape.default, (write, [-1])))
                    end = stop
                length = node.args[0].meta["val"].numel()  # a sharded bucket is padded to W equal shards
                if length > end:
                    pieces.append(graph.call_function(aten.new_zeros.default, (node.args[1][-1], [length - end])))
                flat = graph.call_function(aten.cat.default, (pieces,))
            flat.meta.update(node.meta)
            node.replace_all_uses_with(flat)
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if "bucket" in node.meta and not node.users and (node.op == "get_attr" or is_view(node)):
            graph.erase_node(node)


def _into_bucket(dest: fx.Node) -> bool:
    """Whether ``dest`` is a slot of a bucket buffer (a constant or a buffer the step allocates), which the
    functional form replaces by a ``cat``; copies into anything else (a gathered bucket into the flat
    parameters) are real writes and stay."""
    ranged = flat_range(dest)
    root = ranged[0] if ranged is not None else dest
    return "bucket" in root.meta and (root.op == "get_attr" or root.target is aten.empty.memory_format)


def capability_tag() -> str:
    """torch's compile cache tag with the CPU capability added (the user's own tag, if any, kept in front)."""
    mark = f"cpu-capability={torch.backends.cpu.get_cpu_capability()}"
    user = torch.compiler.config.cache_key_tag
    return f"{user}|{mark}" if user else mark


class CompiledProgram:
    """A program compiled on its first call; ``seconds`` is how long that call took (compiling included)."""

    def __init__(self, gm: fx.GraphModule, variant: str):
        self.variant = variant
        self.fn: Callable = torch.compile(functional_copy(gm), dynamic=False, fullgraph=True)
        self.seconds: float | None = None
        self.cache_tag = capability_tag()

    def __call__(self, *inputs):
        with torch.compiler.config.patch(cache_key_tag=self.cache_tag):  # a recompile may happen on any call
            return self._call(*inputs)

    def _call(self, *inputs):
        if self.seconds is not None:
            try:
                return self.fn(*inputs)
            except FailOnRecompileLimitHit as exc:  # Dynamo checks its guards before running anything
                raise ConfigurationError(
                    f"compile=True: the '{self.variant}' program recompiled on every call until torch's limit. "
                    "A Python float input changed from call to call: the lr of an optimizer on the generic path "
                    "(every optimizer but SGD, Adam and AdamW), which is fed as a float, under a scheduler that "
                    "changes it each step. Use SGD, Adam or AdamW (their per-step values are tensors), a "
                    "scheduler that changes lr rarely, or compile=False."
                ) from exc
        start = time.perf_counter()
        try:
            out = self.fn(*inputs)
        except TorchDynamoException as exc:  # compiling failed; nothing of the program has run
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ConfigurationError(
                f"compile=True: the '{self.variant}' program of this mode cannot be compiled by torch.compile "
                f"({type(exc).__name__}: {first}). Run it with compile=False."
            ) from exc
        self.seconds = time.perf_counter() - start
        log.info("compiled the '%s' program in %.1f s (first call included)", self.variant, self.seconds)
        return out
