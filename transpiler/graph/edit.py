"""Small, careful helpers for rewriting fx graphs.

New nodes get ``meta["val"]`` (a fake tensor computed from their inputs' fake
values) so later passes and verifiers know shapes and dtypes without running
anything, and ``meta["role"]`` so every node keeps a role.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .collectives import is_collective
from .p2p import is_exchange


def fake_value(node: fx.Node) -> Any:
    return node.meta.get("val")


def fake_mode(graph: fx.Graph) -> FakeTensorMode | None:
    """The fake mode the graph's values were traced in (None: a graph with no tensor value)."""
    return next((n.meta["val"].fake_mode for n in graph.nodes if isinstance(n.meta.get("val"), FakeTensor)), None)


def ancestors(nodes: list[fx.Node], ordered: bool = False) -> set[fx.Node]:
    """``nodes`` and every node they read, directly or not (``ordered``: every node they must come after,
    :func:`dependencies`)."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(dependencies(node) if ordered else node.all_input_nodes)
    return seen


def _fake_call(graph: fx.Graph, target: Callable, args: tuple, kwargs: dict) -> Any:
    """The node's value on fake tensors: no real computation, just shapes, dtypes and devices.

    A factory op (``eye``, ``scalar_tensor``) has no tensor input; it runs in the graph's fake mode. An input
    that carries no value (a Python number the runtime feeds, such as the generic path's ``lr``) stands in as
    1.0: only shapes are computed."""
    vals = fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val", 1.0))
    if target is operator.getitem:  # one item of a multi-output value: index it, do not rescan it
        return vals[0][0][vals[0][1]]
    mode = next((v.fake_mode for v in torch.utils._pytree.tree_iter(vals) if isinstance(v, FakeTensor)), None)
    if mode is None and not any(isinstance(a, fx.Node) for a in torch.utils._pytree.tree_iter((args, kwargs))):
        mode = fake_mode(graph)
    if mode is None:
        return None
    with mode:
        return target(*vals[0], **vals[1])


def emit(graph: fx.Graph, target: Callable, args: tuple, kwargs: dict | None = None, **meta: Any) -> fx.Node:
    """Create a call_function node at the graph's current insert point, with fake value and meta. A caller that
    knows the value (``val=``: a multi-tensor op's results are those of the per-tensor ops it replaces) spares
    the fake dispatch, which for a ``_foreach_*`` op over a model's parameters makes a fake tensor per one."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    if "val" not in meta:
        node.meta["val"] = _fake_call(graph, target, args, kwargs)
    node.meta.update(meta)
    return node


def refresh_value(graph: fx.Graph, node: fx.Node) -> None:
    """Recompute ``meta["val"]`` of a node whose inputs changed shape (fake tensors, nothing runs); raises what
    the op raises when its inputs no longer fit."""
    node.meta["val"] = _fake_call(graph, node.target, node.args, node.kwargs)


class Cursor:
    """Inserts nodes one after another *in order* after an anchor.

    ``graph.inserting_after(n)`` reverses several nodes created in one block;
    this inserts each new node right before the anchor's successor instead.
    """

    def __init__(self, graph: fx.Graph, after: fx.Node):
        self.graph = graph
        if after.op == "placeholder":  # ops go after every input, even those a pass added later
            after = [n for n in graph.nodes if n.op == "placeholder"][-1]
        self.anchor = after

    def emit(self, target: Callable, args: tuple, kwargs: dict | None = None, **meta: Any) -> fx.Node:
        with self.graph.inserting_after(self.anchor):
            node = emit(self.graph, target, args, kwargs, **meta)
        self.anchor = node
        return node

    def emit_each(self, target: Callable, args: tuple, kwargs: dict | None = None, **meta: Any) -> list[fx.Node]:
        """One multi-tensor op (a ``_foreach_*`` overload over lists of nodes) and its results one by one
        (``getitem``): a per-tensor loop as one dispatch, the same bits on the CPU (it runs the per-tensor
        kernel on each tensor in turn)."""
        joined = self.emit(target, args, kwargs, **meta)
        return [self.emit(operator.getitem, (joined, i), **meta) for i in range(len(joined.meta["val"]))]

    def copy(self, nodes: list[fx.Node], env: dict[fx.Node, Any], prefix: str = "", **meta: Any) -> dict:
        """Copy ``nodes`` (in order) here, each reading ``env[x]`` for an input ``x`` found there; returns
        ``env`` with every copy under its original. ``prefix`` starts the copies' names (``trial0_mm``)."""
        for node in nodes:
            with self.graph.inserting_after(self.anchor):
                copy = self.graph.node_copy(node, lambda a: env.get(a, a))
            if prefix:
                copy.name = self.graph._graph_namespace.create_name(f"{prefix}{node.name}", None)
            copy.meta.update(meta)
            env[node] = self.anchor = copy
        return env


def node_bytes(node: fx.Node) -> int:
    val = fake_value(node)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def move_before(node: fx.Node, anchor: fx.Node) -> None:
    if node.next is not anchor:
        anchor.prepend(node)


def position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


AFTER = "after"  # meta: the nodes that must run before this one though it reads no value of theirs


def dependencies(node: fx.Node) -> list[fx.Node]:
    """What ``node`` must come after: the nodes it reads, and those ``meta["after"]`` names (an in-place
    multi-tensor op returns nothing, so a reader of the tensors it wrote reads no value of it:
    ``reinplace-optimizer`` records the order there). What reorders nodes keeps these."""
    return node.all_input_nodes + [n for n in node.meta.get(AFTER, ()) if n.graph is node.graph]


def repair_order(graph: fx.Graph, keep: list[fx.Node] | None = None) -> bool:
    """Reorder nodes so each comes after its inputs, moving as little as possible; whether anything moved.

    A pass that inserts one node reading many values (a global norm over every gradient) after the last of
    them can leave earlier readers of its results ahead of it. The new order is networkx's lexicographical
    topological sort keyed by the old position: among the nodes whose inputs are placed, the one that came
    first goes next, so nodes already in order stay where they were. The nodes of ``keep`` keep their relative
    order, whatever their inputs allow; by default the collectives and point-to-point exchanges, whose order
    every rank must share (a rank whose slices are empty has other data dependencies than its peers).
    """
    if keep is None:
        keep = [n for n in graph.nodes if is_collective(n) or is_exchange(n)]
    order = position(graph)
    if all(order[i] < order[n] for n in graph.nodes for i in dependencies(n)):
        return False
    dag = nx.DiGraph()
    dag.add_nodes_from(graph.nodes)
    dag.add_edges_from((i, n) for n in graph.nodes for i in dependencies(n))
    chain = sorted(keep or [], key=order.__getitem__)
    dag.add_edges_from(zip(chain, chain[1:]))
    result = list(nx.lexicographical_topological_sort(dag, key=order.__getitem__))
    for before, node in zip(result, result[1:]):
        if before.next is not node:
            before.append(node)
    return True
