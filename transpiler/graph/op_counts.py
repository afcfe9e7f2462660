"""How many ops a program dispatches per step, by kind, read off its graph: what each pass adds or removes.

Every ``call_function`` node of an aten op dispatches once per step. *Views* (``t``, ``view``, ``slice``,
``as_strided``...) launch no kernel; *copies* (``copy_``, ``clone``) move memory without arithmetic; the rest is
*work*, about one kernel launch each on a GPU. Python-level nodes (``getitem``, symbolic scalar arithmetic)
dispatch nothing. ``bench/host_ops.py`` counts what a step really dispatches; this counts the program, so
``transpiler dump --op-counts`` can say which pass changed what.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
COPIES = frozenset({aten.copy_.default, aten.clone.default})
VIEWLIKE = frozenset({aten.detach.default, aten.alias.default})


def is_view_op(func: torch._ops.OpOverload) -> bool:
    """A view (or ``detach``/``alias``): no kernel, only a dispatch. The one definition, for the graph's counts
    here and for what ``bench/op_count.py`` counts a step dispatch."""
    return func.is_view or func in VIEWLIKE


@dataclass(frozen=True)
class OpCounts:
    work: int
    views: int
    copies: int

    def __str__(self) -> str:
        return f"{self.work} work, {self.views} views, {self.copies} copies"


def op_counts(graph: fx.Graph) -> OpCounts:
    work = views = copies = 0
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if is_view_op(node.target):
            views += 1
        elif node.target in COPIES:
            copies += 1
        else:
            work += 1
    return OpCounts(work, views, copies)
