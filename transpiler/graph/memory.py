"""How many bytes a program's own tensors hold at once while it runs, from its schedule.

A GraphModule's code drops every value after its last reader (``x = None``), so the tensors alive after a node
are those made by it or before it that something later still reads. A node makes a new tensor unless its op
returns an alias of an input (views, in-place ops, ``out=`` forms, ``wait_tensor``) or nothing (in-place
multi-tensor ops); an alias keeps its base alive. Inputs and constants are held by the runtime and not counted
here. The values are the fake tensors each node carries, whose shapes and dtypes are the real ones, so this is
the program's own count of what it allocates, in its order (the CUDA allocator's measured peak is reported
beside it on a GPU).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from .collectives import WAIT


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s result shares, or None when the op allocates its result."""
    if node.target is operator.getitem or node.target is WAIT:
        return node.args[0]
    if "out" in node.kwargs:
        return node.kwargs["out"]
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias_set = schema.returns[0].alias_info.before_set
    for argument, value in zip(schema.arguments, node.args):
        if argument.alias_info is not None and argument.alias_info.before_set & alias_set:
            return value if isinstance(value, fx.Node) else None
    return None


def _returns_nothing(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.returns


def _bytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def peak_transient_bytes(graph: fx.Graph, counted: Callable[[fx.Node], bool] | None = None) -> int:
    """The most bytes of tensors the program itself allocated that are alive at once (inputs not counted);
    with ``counted``, of those allocated by the nodes it accepts (ZeRO-3's gathered buckets, say)."""
    nodes = list(graph.nodes)
    root: dict[fx.Node, fx.Node | None] = {}  # the allocating node whose storage a value lives in
    size: dict[fx.Node, int] = {}
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "get_attr"):
            root[node] = None
            continue
        for arg in node.all_input_nodes:
            base = root.get(arg)
            if base is not None:
                last[base] = i
        if node.op != "call_function":
            continue
        if _returns_nothing(node):  # an in-place multi-tensor op: it writes its inputs, it allocates nothing
            root[node] = None
            continue
        alias = _aliased_input(node)
        if alias is not None:
            root[node] = root.get(alias)
        else:
            root[node] = node
            size[node] = _bytes(node.meta.get("val")) if counted is None or counted(node) else 0
            last.setdefault(node, i)
    frees: dict[int, int] = {}
    for node, end in last.items():
        frees[end] = frees.get(end, 0) + size.get(node, 0)
    live = peak = 0
    for i, node in enumerate(nodes):
        live += size.get(node, 0) if root.get(node) is node else 0
        peak = max(peak, live)
        live -= frees.get(i, 0)
    return peak


def largest_allocation_bytes(graph: fx.Graph) -> int:
    """The bytes of the largest single tensor the program allocates (an all-gathered bucket, a gradient)."""
    sizes = [
        _bytes(value)
        for node in graph.nodes
        if node.op == "call_function" and _aliased_input(node) is None
        for value in _tensors(node.meta.get("val"))
    ]
    return max(sizes, default=0)
