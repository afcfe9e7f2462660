"""Which elements of which tensor a node views: contiguous views of 1-D buffers, as the flat buffers have them.

A bucket's reduced gradients are read back through ``split_with_sizes`` and ``view``; a flat parameter buffer
through ``as_strided`` (the forward) and ``slice`` (a run's update). :func:`flat_range` follows such a chain
back to the tensor it views and says which elements ``[lo, hi)`` it covers, so passes can tell whether two
views overlap (``reinplace-optimizer``) or which slot a view is (``flatten-update``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def is_view(node: fx.Node) -> bool:
    """An aten op whose result is a view of its first argument (``view``, ``t``, ``slice``...)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def contiguous_strides(shape: list[int]) -> list[int]:
    """The strides of a contiguous tensor of ``shape`` (what ``as_strided`` takes to view one in a flat buffer)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def view_step(node: fx.Node) -> int | None:
    """How many elements after the start of its first argument ``node`` starts, when ``node`` is a contiguous
    view of it (a reshape, a unit-step slice of a 1-D tensor, a piece of a split of one, an ``as_strided`` of a
    contiguous one); None when it is not such a view."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source, val = node.args[0], node.meta.get("val")
    base = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(base, torch.Tensor) or not val.is_contiguous():
        return None
    if node.target in RESHAPES and base.is_contiguous():
        return 0
    flat = base.dim() == 1
    if node.target is aten.slice.Tensor and flat:
        dim, start = (list(node.args[1:3]) + [0, 0])[:2]
        step = node.args[4] if len(node.args) > 4 else 1
        return start if dim == 0 and step == 1 and isinstance(start, int) and start >= 0 else None
    if node.target is aten.as_strided.default and base.is_contiguous():
        offset = node.args[3] if len(node.args) > 3 else 0
        return offset - base.storage_offset() if isinstance(offset, int) else None
    return None


def _split_piece(node: fx.Node) -> int | None:
    """The start of ``split_with_sizes(x, sizes)[i]`` in 1-D ``x``."""
    split = node.args[0] if node.target is operator.getitem else None
    if not isinstance(split, fx.Node) or split.target is not aten.split_with_sizes.default:
        return None
    dim = split.args[2] if len(split.args) > 2 else 0
    return sum(split.args[1][: node.args[1]]) if dim == 0 and split.args[0].meta["val"].dim() == 1 else None


def flat_range(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """The tensor ``node`` views (through views that keep it contiguous) and the elements ``[lo, hi)`` of it that
    it covers; ``(node, 0, numel)`` for a node that views nothing. None for a node with no tensor value."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    offset = 0
    while True:
        step = view_step(node)
        if step is not None:
            offset, node = offset + step, node.args[0]
            continue
        piece = _split_piece(node)
        if piece is not None:
            offset, node = offset + piece, node.args[0].args[0]
            continue
        return node, offset, offset + val.numel()


def contiguous_views(root: fx.Node) -> dict[fx.Node, tuple[int, int]]:
    """Every node that views ``root`` (through :func:`flat_range`'s chains), with the elements it covers."""
    found: dict[fx.Node, tuple[int, int]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in found:
                continue
            ranged = flat_range(user) if view_step(user) is not None or _split_piece(user) is not None else None
            if ranged is not None and ranged[0] is root:
                found[user] = ranged[1:]
                stack.append(user)
            elif user.target is aten.split_with_sizes.default and user.args[0] is node:
                stack.append(user)
    return found


def viewed_root(value: object) -> fx.Node | None:
    """The node a value views, through any chain of views (itself when it views nothing; None for a non-node)."""
    while isinstance(value, fx.Node) and is_view(value):
        value = value.args[0]
    return value if isinstance(value, fx.Node) else None


def written_input(node: fx.Node) -> fx.Node | None:
    """The program input ``node`` writes into, itself or through a view (an argument its schema marks ``a!``)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return None
    for argument, value in zip(schema.arguments, node.args, strict=False):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            root = viewed_root(tensor)
            if root is not None and root.op == "placeholder":
                return root
    return None
