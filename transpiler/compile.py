"""``transpile(..., compile=True)``: each rewritten step program compiled by ``torch.compile`` (Inductor).

The program is compiled as it is, collectives included: Inductor sees torch's functional collectives
and keeps them, in the order the passes left them. Two things change before compiling, on a copy:
the in-place bucket all-reduces (``all_reduce_``, which functionalization cannot take) become the
out-of-place ``all_reduce``. That is safe because every reader of a reduced bucket reads its wait's
result, never the buffer, and the check below makes sure of it. Each program is compiled with
``fullgraph=True`` and ``dynamic=False``, on its first call: a program that cannot be compiled fails
then, before any of its collectives runs, with a :class:`ConfigurationError` that names it. A new
batch shape is a new program and compiles again.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.exc import TorchDynamoException

from .collectives import C10D
from .errors import ConfigurationError
from .graph_edit import position

log = logging.getLogger("transpiler")


def functional_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the program whose collectives are all out of place (what torch.compile takes)."""
    graph = copy.deepcopy(gm.graph)
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


class CompiledProgram:
    """A program compiled on its first call; ``seconds`` is how long that call took (compiling included)."""

    def __init__(self, gm: fx.GraphModule, variant: str):
        self.variant = variant
        self.fn: Callable = torch.compile(functional_copy(gm), dynamic=False, fullgraph=True)
        self.seconds: float | None = None

    def __call__(self, *inputs):
        if self.seconds is not None:
            return self.fn(*inputs)
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
