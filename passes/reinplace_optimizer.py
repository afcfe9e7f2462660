"""``reinplace-optimizer``: let the optimizer update tensors in place, as eager does.

Requires: a functional step graph (any pass before it may have run).
Guarantees: an out-of-place optimizer op (``add``, ``mul``, ``lerp``,
``addcmul``, ``addcdiv``, ``div``, ``sqrt``, ``neg``) becomes its in-place twin
when the tensor it would overwrite is a parameter, an optimizer-state input or
an optimizer temporary of the same shape and dtype, and nothing reads that
storage later (the graph's outputs count as later). The kernels are the same,
so results are bitwise unchanged; what goes away is a fresh allocation per
parameter and state tensor each step. Runs last: no pass after it needs to see
the functional form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.edit import position
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram

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
WRITABLE_INPUTS = ("param", "state")


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
    return node.meta.get("role") == "optimizer" and node.target in set(INPLACE) | set(INPLACE.values())


@dataclass(frozen=True)
class ReinplaceOptimizer(Pass):
    name = "reinplace-optimizer"
    summary = "turn out-of-place optimizer updates into in-place ones where nothing reads the old value"

    def run(self, program: StepProgram) -> bool:
        order = position(program.graph)
        root: dict[fx.Node, fx.Node] = {}  # storage each in-place result aliases
        aliases: dict[fx.Node, list[fx.Node]] = {}
        changed = False
        for node in program.graph.nodes:
            if node.meta.get("role") != "optimizer" or node.target not in INPLACE:
                continue
            target = node.args[0]
            if not isinstance(target, fx.Node) or not _writable(target) or not _same_layout(target, node):
                continue
            base = root.get(target, target)
            readers = [u for m in aliases.get(base, [base]) for u in m.users if u is not node]
            if any(u.op == "output" or order[u] > order[node] for u in readers):
                continue
            node.target = INPLACE[node.target]
            node.meta["inplace_of"] = base.name
            root[node] = base
            aliases.setdefault(base, [base]).append(node)
            changed = True
        return changed
