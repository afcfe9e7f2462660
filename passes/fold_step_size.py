"""Adam's step size handed to ``addcdiv`` as its value, as eager hands it, instead of multiplied in first.

The traced update is ``addcdiv(p, exp_avg * s, denom)`` (``trace/optimizers/twins.py``): ``s``, the step size,
changes every step, so it is a 0-d tensor input, and ``addcdiv``'s ``value`` takes no tensor. That costs a pass
over every ``exp_avg`` and a fresh tensor each, every step: on the CPU (one thread, tensors of the wide bench
GPT's shapes, 3.3M entries) product and ``addcdiv`` took 3.9-4.9 ms against 1.4-1.5 for the folded call, the
product alone 2.5 ms into new tensors (1,480 page faults a call) against 1.3 into tensors held.
Eager's AdamW calls ``addcdiv_(p, exp_avg, denom, value=-step_size)`` (foreach: ``_foreach_addcdiv_`` with a
list of Python doubles); ``_foreach_addcdiv.Tensor`` takes those doubles as a 1-D float64 tensor on the CPU,
which the program makes from ``s`` with one small op (``repeat``). Its CPU kernel is the per-tensor
``addcdiv``'s: float32 and float64 compute ``p + v * a / d`` in the dtype, ``v`` cast to it, the bits of the
product multiplied in first; bfloat16 and float16 compute it in float and round once, where the product rounded
``a * s`` on its own: there the fold gives eager's bits in bfloat16 and the traced form did not (a bfloat16
MLP's AdamW differed from eager's at its second step; float16 AdamW leaves eager elsewhere, docs/bitwise.md).
``tests/test_fold_step_size.py`` holds both. On a GPU the kernel would read its scalars on the host: left as
traced.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transpiler.graph.edit import Cursor

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def fold_step_sizes(graph: fx.Graph) -> int:
    """Fold each ``addcdiv(p, a * s, d)`` of the update (per tensor, or a multi-tensor op over a multi-tensor
    product) into ``_foreach_addcdiv.Tensor(p, a, d, s repeated)``; how many it folded."""
    folded = 0
    repeated: dict[tuple[fx.Node, int], fx.Node] = {}  # (step size, count) -> its repeat, made once
    for node in list(graph.nodes):
        if node.meta.get("role") != "optimizer" or _value(node) != 1:
            continue
        if node.target is aten._foreach_addcdiv.Scalar:
            product = _product_of_items(node.args[1])
            if product is not None:
                _replace(graph, node, node.args[0], product, node.args[2], repeated, items=False)
                folded += 1
        elif node.target is aten.addcdiv.default:
            product = node.args[1]
            if _scaled(product) and _fits([node.args[0], product.args[0], node.args[2]], product):
                _replace(graph, node, [node.args[0]], product, [node.args[2]], repeated, items=True)
                folded += 1
    return folded


def _value(node: fx.Node) -> object:
    """The ``value`` an ``addcdiv`` (or its multi-tensor twin) passes, positional or keyword (default 1)."""
    if len(node.args) > 3:
        return node.args[3]
    return node.kwargs.get("value", 1)


def _scaled(node: object) -> bool:
    """Whether ``node`` is ``a * s``, ``s`` a 0-d tensor on the CPU, and read once."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    return node.target is aten.mul.Tensor and len(node.args) == 2 and _host_scalar(node.args[1])


def _host_scalar(value: object) -> bool:
    """Whether ``value`` is a node holding a 0-d tensor on the CPU (a scalar slot)."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.device.type == "cpu"


def _float_on_cpu(val: object) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype in _FLOATS and val.device.type == "cpu"


def _fits(tensors: list[object], product: fx.Node) -> bool:
    """Whether every tensor is a floating-point CPU tensor of the product's shape (no broadcast)."""
    shape = product.meta.get("val").shape if isinstance(product.meta.get("val"), torch.Tensor) else None
    vals = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in tensors]
    return all(_float_on_cpu(val) and val.shape == shape for val in vals)


def _product_of_items(items: object) -> fx.Node | None:
    """The ``_foreach_mul.Tensor(a, s)`` whose results ``items`` are, each read only there, in its order."""
    if not isinstance(items, (list, tuple)) or not items:
        return None
    first = items[0]
    if not isinstance(first, fx.Node) or first.target is not operator.getitem:
        return None
    product = first.args[0]
    if not isinstance(product, fx.Node) or product.target is not aten._foreach_mul.Tensor:
        return None
    if len(product.users) != len(items) or len(product.args[0]) != len(items):
        return None
    for i, item in enumerate(items):
        if not (isinstance(item, fx.Node) and item.target is operator.getitem and item.args == (product, i)):
            return None
        if len(item.users) != 1:
            return None
    if not _host_scalar(product.args[1]):
        return None
    return product if all(_float_on_cpu(item.meta.get("val")) for item in items) else None


def _replace(
    graph: fx.Graph,
    node: fx.Node,
    params: list,
    product: fx.Node,
    denoms: list,
    repeated: dict[tuple[fx.Node, int], fx.Node],
    *,
    items: bool,
) -> None:
    """``node`` (an ``addcdiv`` over ``product``'s results) as one ``_foreach_addcdiv.Tensor``, reading the step
    size repeated (from ``repeated`` when another fold made it already); ``items``: the node was per tensor, so its
    readers read the new op's one result."""
    factors = product.args[0] if isinstance(product.args[0], (list, tuple)) else [product.args[0]]
    key = (product.args[1], len(params))
    if key not in repeated:
        # right after the inputs: it reads one, and an update that reads no collective goes first in
        # schedule-collectives' order, so a second run of it finds it in place
        first = next(n for n in graph.nodes if n.op == "placeholder")
        repeated[key] = Cursor(graph, first).emit(aten.repeat.default, (key[0], [key[1]]), role="optimizer")
    values = repeated[key]
    cursor = Cursor(graph, node.prev)
    meta = {k: v for k, v in node.meta.items() if k not in ("val", "stack_trace")}
    vals = [node.meta["val"]] if items else node.meta["val"]
    joined = cursor.emit(aten._foreach_addcdiv.Tensor, (list(params), list(factors), list(denoms), values), val=vals)
    joined.meta.update(meta)
    if items:
        result = cursor.emit(operator.getitem, (joined, 0), **meta, val=node.meta["val"])
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        graph.erase_node(product)
        return
    node.replace_all_uses_with(joined)
    graph.erase_node(node)
    for item in list(product.users):
        graph.erase_node(item)
    graph.erase_node(product)
