"""``reinplace-optimizer``: let the optimizer update tensors in place, as eager does.

Requires: a functional step graph (any pass before it may have run).
Guarantees: an out-of-place optimizer op (``add``, ``mul``, ``lerp``,
``addcmul``, ``addcdiv``, ``div``, ``sqrt``, ``neg``) becomes its in-place twin
when the tensor it would overwrite is a parameter, an optimizer-state input, a
flat buffer (``flatten-update``) or a view of one, or an optimizer temporary of
the same shape and dtype, and nothing reads those elements later (the graph's
outputs count as later; a ``copy_`` into them writes, it does not read). Their
multi-tensor twins (``foreach-update``) likewise, when every tensor of the list
may be overwritten; the in-place form returns nothing, so its readers then read
the tensors it wrote, and record it in ``meta["after"]`` for what reorders
nodes. The kernels are the same, so results are bitwise unchanged; what goes
away is a fresh allocation per parameter and state tensor each step. A
``copy_`` that then writes a value back where it already is goes too. First
(``fold-step-size``, on by default) Adam's ``addcdiv(p, exp_avg * s, denom)``
takes the step size as its value, as eager's does, on the CPU
(``fold_step_size.py``): no product tensor per parameter each step, the same
bits in float32 and float64, eager's in bfloat16. Runs last: no pass after it needs to see the functional form.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from transpiler.graph.edit import AFTER, position
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.program import StepProgram
from transpiler.graph.views import contiguous_views, flat_range

from .fold_step_size import fold_step_sizes

aten = torch.ops.aten
INPLACE = {
    aten.add.Tensor: aten.add_.Tensor,
    aten.mul.Tensor: aten.mul_.Tensor,
    aten.lerp.Scalar: aten.lerp_.Scalar,
    aten.addcmul.default: aten.addcmul_.default,
    aten.addcdiv.default: aten.addcdiv_.default,
    aten.div.Tensor: aten.div_.Tensor,
    aten.sqrt.default: aten.sqrt_.default,
    aten.neg.default: aten.neg_.default,
}
# the multi-tensor twins of those ops (``foreach-update``), every overload that has an in-place one
FOREACH_INPLACE = {
    getattr(functional, overload): getattr(getattr(aten, name + "_"), overload)
    for name in ("_foreach_add", "_foreach_mul", "_foreach_lerp", "_foreach_addcmul", "_foreach_addcdiv")
    + ("_foreach_div", "_foreach_sqrt", "_foreach_neg")
    for functional in (getattr(aten, name),)
    for overload in getattr(aten, name + "_").overloads()
}
WRITABLE_INPUTS = ("param", "state", "flat")


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and va.shape == vb.shape
        and va.dtype == vb.dtype
        and va.stride() == vb.stride()
    )


def _writable(node: fx.Node) -> bool:
    if node.op == "placeholder":
        return node.meta.get("port") is not None and node.meta["port"].kind in WRITABLE_INPUTS
    if node.meta.get("role") != "optimizer":
        return False
    if node.target is operator.getitem:  # a tensor of a multi-tensor op's result: a temporary of the update
        return isinstance(node.args[0], fx.Node) and node.args[0].target in FOREACH_INPLACE
    return node.target in set(INPLACE) | set(INPLACE.values())


def _foreach_results(node: fx.Node) -> list[fx.Node] | None:
    """The ``getitem`` of each tensor a multi-tensor op computes, in its list's order; None when something else
    reads the op's result or a tensor is not read."""
    items = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    if len(items) != len(node.users) or sorted(items) != list(range(len(node.args[0]))):
        return None
    return [items[j] for j in range(len(items))]


class _Storage:
    """The writable tensors and what aliases each: its contiguous views and the in-place results written into it,
    each with the elements ``[lo, hi)`` of the tensor it covers."""

    def __init__(self, program: StepProgram) -> None:
        self.order = position(program.graph)
        self.aliases: dict[fx.Node, list[tuple[fx.Node, int, int]]] = {}
        self.views: set[fx.Node] = set()
        self.region: dict[fx.Node, tuple[fx.Node, int, int]] = {}  # an aliasing node -> (tensor, lo, hi)

    def of(self, node: fx.Node) -> tuple[fx.Node, int, int] | None:
        """Which writable tensor ``node`` is, views or was written into, and where; None if none."""
        if node in self.region:
            return self.region[node]
        ranged = flat_range(node)
        if ranged is None or not _writable(ranged[0]):
            return None
        root = ranged[0]
        if root is not node and root.op != "placeholder":
            return None  # a view of a temporary: leave it out of place
        if root not in self.aliases:
            numel = root.meta["val"].numel()
            views = contiguous_views(root)
            self.views.update(views)
            self.aliases[root] = [(root, 0, numel)] + [(v, lo, hi) for v, (lo, hi) in views.items()]
            self.region.update({v: (root, lo, hi) for v, lo, hi in self.aliases[root]})
        return self.region[node]

    def read_later(self, region: tuple[fx.Node, int, int], node: fx.Node) -> bool:
        """Whether anything after ``node`` (or the output) reads the old values of ``region``."""
        root, lo, hi = region
        for alias, a, b in self.aliases[root]:
            if b <= lo or a >= hi:
                continue
            if alias.meta.get("final"):  # the value a flat buffer keeps after the step: read after the graph
                return True
            for user in alias.users:
                if user is node or user in self.views:  # a view reads nothing
                    continue
                if user.target is aten.copy_.default and user.args[0] is alias:
                    continue  # it writes these elements, it does not read them
                if user.op == "output" or self.order[user] > self.order[node]:
                    return True
        return False

    def written(self, node: fx.Node, region: tuple[fx.Node, int, int]) -> None:
        root, lo, hi = region
        self.aliases[root].append((node, lo, hi))
        self.region[node] = region


@dataclass(frozen=True)
class ReinplaceOptimizer(Pass):
    name = "reinplace-optimizer"
    invalidates = frozenset({Fact.FUNCTIONAL})
    summary = "turn out-of-place optimizer updates into in-place ones where nothing reads the old value"
    # off where Inductor compiles the program: it fuses the product into the update itself, and has no lowering
    # for the multi-tensor op the fold makes (ModeConfig.strategy)
    fold_step_size: bool = option(
        True, help="on the CPU, Adam's step size as addcdiv's value (eager's form), not multiplied in first"
    )

    def for_inductor(self) -> ReinplaceOptimizer:
        """Unfolded: Inductor fuses the product into the update and has no lowering for the folded op."""
        return replace(self, fold_step_size=False)

    def run(self, program: StepProgram) -> bool:
        folded = fold_step_sizes(program.graph) if self.fold_step_size else 0
        if folded:
            program.decisions["reinplace-optimizer"] = f"step size as addcdiv's value: {folded} ops"
        storage = _Storage(program)
        written: set[fx.Node] = set()
        for node in program.graph.nodes:
            if node.meta.get("role") != "optimizer" or node.target not in INPLACE:
                continue
            target = node.args[0]
            if not isinstance(target, fx.Node) or not _same_layout(target, node):
                continue
            region = storage.of(target)
            if region is None or storage.read_later(region, node):
                continue
            node.target = INPLACE[node.target]
            node.meta["inplace_of"] = region[0].name
            storage.written(node, region)
            written.add(node)
        for node in list(program.graph.nodes):
            if (
                node.meta.get("role") == "optimizer"
                and node.target in FOREACH_INPLACE
                and _reinplace_foreach(node, storage)
            ):
                written.add(node)
        return _drop_self_copies(program, storage) or bool(written) or folded > 0


def _reinplace_foreach(node: fx.Node, storage: _Storage) -> bool:
    """A multi-tensor op in place, when every tensor of its first list may be overwritten (as for one op): its
    readers then read the tensors it wrote, since the in-place op returns nothing. All or none of the list."""
    results = _foreach_results(node)
    targets = node.args[0]
    if results is None or not all(isinstance(t, fx.Node) and _same_layout(t, r) for t, r in zip(targets, results)):
        return False
    regions = [storage.of(t) for t in targets]
    if any(r is None or storage.read_later(r, node) for r in regions):
        return False
    spans = sorted((storage.order[root], lo, hi) for root, lo, hi in regions)
    if any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:])):
        return False  # two tensors of the list share elements: each would see the other's write
    node.target = FOREACH_INPLACE[node.target]
    node.meta["inplace_of"] = [root.name for root, _, _ in regions]
    for target, result in zip(targets, results):
        for reader in result.users:  # no value of the op says that it ran first
            if node not in reader.meta.setdefault(AFTER, []):
                reader.meta[AFTER].append(node)
        result.replace_all_uses_with(target)
        result.graph.erase_node(result)
    return True


def _drop_self_copies(program: StepProgram, storage: _Storage) -> bool:
    """``copy_(dest, value)`` where ``value`` was computed in place in ``dest``'s elements: nothing to copy."""
    dropped = False
    for node in list(program.graph.nodes):
        if node.target is not aten.copy_.default or node.meta.get("role") != "optimizer":
            continue
        dest, value = node.args[0], node.args[1]
        if value in storage.region and storage.region.get(value) == storage.of(dest):
            node.replace_all_uses_with(value)  # the value, which depends on the update: later readers stay after it
            value.meta["final"] = True  # what the copy said: these elements keep this value (a later run sees it)
            program.graph.erase_node(node)
            dropped = True
    return dropped
