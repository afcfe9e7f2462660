"""``schedule-collectives``: issue collectives early, wait for them late.

Requires: communication nodes tagged ``role="communication"``.
Guarantees: every node on the issuing side of a collective (flatten, cat,
the collective) sits right after its latest input, so communication overlaps
the rest of backward; every wait and the unpacking after it sits right before
its first reader. Only communication nodes move, in a deterministic order, so
all ranks keep the same collective sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from transpiler.collectives import is_wait
from transpiler.graph_edit import position
from transpiler.pipeline import Pass
from transpiler.program import StepProgram


def _completion_side(nodes: list[fx.Node]) -> set[fx.Node]:
    after: set[fx.Node] = set()
    for node in nodes:
        if is_wait(node) or any(i in after for i in node.all_input_nodes):
            after.add(node)
    return after


def _only_between(node: fx.Node, reader: fx.Node, allowed: set[fx.Node]) -> bool:
    """Whether every node between ``node`` and its later ``reader`` is in ``allowed`` (already sunk there):
    then moving ``node`` would only reorder that block, and a second run must find nothing to do."""
    cursor = node.next
    while cursor is not reader:
        if cursor not in allowed or cursor.op == "output":
            return False
        cursor = cursor.next
    return True


@dataclass(frozen=True)
class ScheduleCollectives(Pass):
    name = "schedule-collectives"
    summary = "move collectives as early as inputs allow and waits as late as uses allow"

    def run(self, program: StepProgram) -> bool:
        graph = program.graph
        comm = [n for n in graph.nodes if n.meta.get("role") == "communication"]
        completion = _completion_side(comm)
        before = list(graph.nodes)
        order: dict[fx.Node, float] = dict(position(graph))  # kept up to date with fractional positions
        for node in comm:  # issuing side, forwards: hoist right after the latest input
            if node in completion:
                continue
            latest = max(node.all_input_nodes, key=order.__getitem__)
            if latest.next is not node:
                order[node] = (order[latest] + order[latest.next]) / 2
                latest.append(node)
        for node in reversed(comm):  # completion side, backwards: sink right before the first reader
            if node not in completion or not node.users:
                continue
            first = min(node.users, key=order.__getitem__)
            if not _only_between(node, first, completion):
                order[node] = (order[first.prev] + order[first]) / 2
                first.prepend(node)
        return list(graph.nodes) != before
