"""``schedule-collectives``: issue collectives early, wait for them late.

Requires: communication nodes tagged ``role="communication"``.
Guarantees: every node on the issuing side of a collective (flatten, cat,
the collective) sits right after its latest input, so communication overlaps
the rest of backward; the optimizer's updates run in the order their
collectives complete (a stable sort by the last collective each depends on),
so the parameters of the first buckets update while the last bucket is still
being reduced; every wait and the unpacking after it sits right before its
first reader. A node its pass marked ``pinned`` keeps its place (ZeRO-3's
parameter gathers, issued one bucket ahead: hoisted, they would all be in
flight at once and hold the whole model; Streaming DiLoCo's second collective,
issued where the applying step's forward ends: sunk, it would wait at the end).
Collectives keep their order (none is hoisted ahead of the one before it, even
where ranks' programs differ, as a sharded update's do), so all ranks keep the
same collective sequence.

An all-gather of CPU tensors (gloo) runs alone: every collective issued before
it is waited before it is issued, and it is waited at once. torch 2.13's gloo
corrupts the heap when all-gathers are in flight together ("malloc(): unaligned
tcache chunk detected", SIGSEGV; bench/gloo_all_gather.py reproduces it with
torch alone), so overlapping them on the CPU is not safe. An all-gather its pass
marked ``in_flight_alone`` may stay in flight beside compute, still with no
other collective: the next collective issued after it waits for it first.
GPU collectives (NCCL) keep the full overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from transpiler.graph.collectives import C10D, is_collective, is_wait
from transpiler.graph.edit import dependencies, position, repair_order
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram


def _completion_side(nodes: list[fx.Node]) -> set[fx.Node]:
    after: set[fx.Node] = set()
    for node in nodes:
        if is_wait(node) or any(i in after for i in dependencies(node)):
            after.add(node)
    return after


def _only_between(node: fx.Node, reader: fx.Node, allowed: set[fx.Node]) -> bool:
    """Whether every node between ``node`` and its later ``reader`` is in ``allowed`` (already moved there):
    then moving ``node`` would only reorder that block, and a second run must find nothing to do."""
    cursor = node.next
    while cursor is not reader:
        if cursor not in allowed or cursor.op == "output":
            return False
        cursor = cursor.next
    return True


def _move(graph: fx.Graph, order: dict[fx.Node, float], node: fx.Node, before: fx.Node) -> None:
    """Move ``node`` right before ``before``, keeping ``order`` (each node's position) up to date: halfway
    between its new neighbours, or, where no float lies between them any more, every position counted again.
    Many nodes moved before one reader halve one gap each time (a multi-tensor update reads the gradient slices
    of every bucket: 50 of them exhaust a float's 52 bits), and tied positions would put a value after its
    reader."""
    low, high = order[before.prev], order[before]
    before.prepend(node)
    middle = (low + high) / 2
    if low < middle < high:
        order[node] = middle
    else:
        order.update(position(graph))


def _updates_in_completion_order(graph: fx.Graph) -> None:
    """Stable-sort the optimizer's nodes by the last collective each depends on (its issue index)."""
    issued: dict[fx.Node, int] = {}
    for node in graph.nodes:
        own = [len(issued)] if is_collective(node) else []
        issued[node] = max([issued[i] for i in dependencies(node)] + own, default=-1)
    updates = [n for n in graph.nodes if n.meta.get("role") == "optimizer" and n.op == "call_function"]
    ordered = sorted(updates, key=lambda n: issued[n])  # stable: ties keep their order
    if ordered == updates:
        return
    output = graph.output_node()
    for node in ordered:
        output.prepend(node)
    # what read the moved updates (extra outputs, metrics, gathers) follows them; collectives keep their order
    repair_order(graph, [n for n in graph.nodes if is_collective(n)])


@dataclass(frozen=True)
class ScheduleCollectives(Pass):
    name = "schedule-collectives"
    summary = "issue collectives early, wait late, run updates in bucket completion order"

    def run(self, program: StepProgram) -> bool:
        graph = program.graph
        comm = [n for n in graph.nodes if n.meta.get("role") == "communication"]
        completion = _completion_side(comm)
        before = list(graph.nodes)
        order: dict[fx.Node, float] = dict(position(graph))  # kept up to date with fractional positions
        fixed: set[fx.Node] = set()  # views of constants (bucket buffers): placed with the inputs already
        previous: list[fx.Node] = []  # the last collective placed: the next one may not move ahead of it
        placed: set[fx.Node] = set()  # issuing-side nodes hoisted (or found in place) so far
        for node in comm:  # issuing side, forwards: hoist right after the latest input
            if node in completion:
                continue
            if node.meta.get("pinned"):  # placed by its pass (ZeRO-3's parameter gathers prefetch one ahead)
                previous = [node] if is_collective(node) else previous
                continue
            bound = previous if is_collective(node) else []
            if not bound and all(i.op in ("placeholder", "get_attr") or i in fixed for i in dependencies(node)):
                fixed.add(node)
                previous = [node] if is_collective(node) else previous
                continue
            latest = max(dependencies(node) + bound, key=order.__getitem__)
            # only nodes hoisted before it in between: already where the first run put it (a second run must
            # find nothing to do)
            if latest.next is not node and not _only_between(latest, node, placed):
                _move(graph, order, node, latest.next)
            placed.add(node)
            previous = [node] if is_collective(node) else previous
        _updates_in_completion_order(graph)
        order = dict(position(graph))
        for node in reversed(comm):  # completion side, backwards: sink right before the first reader
            if node not in completion or not node.users or node.meta.get("pinned"):
                continue
            first = min(node.users, key=order.__getitem__)
            if not _only_between(node, first, completion):
                _move(graph, order, node, first)
        _host_all_gathers_alone(graph)
        return list(graph.nodes) != before


def _host_all_gather(node: fx.Node) -> bool:
    return node.target is C10D.all_gather_into_tensor.default and node.args[0].meta["val"].device.type == "cpu"


def _host_all_gathers_alone(graph: fx.Graph) -> None:
    """Every all-gather of CPU tensors runs with no other collective in flight: the waits of the collectives
    still in flight move right before it, and its own wait right after it (a wait moved earlier stays after
    its collective and before its readers). One marked ``in_flight_alone`` keeps its wait where it is, and the
    next collective issued before that wait waits for it first."""
    in_flight: dict[fx.Node, list[fx.Node]] = {}  # collective -> its waits, for those issued and not waited yet
    for node in list(graph.nodes):
        if is_wait(node):
            in_flight.pop(node.args[0], None)
        if not is_collective(node):
            continue
        waits = [u for u in node.users if is_wait(u)]
        if _host_all_gather(node) or any(map(_host_all_gather, in_flight)):
            for wait in [w for pending in in_flight.values() for w in pending]:
                node.prepend(wait)
            in_flight.clear()
        if _host_all_gather(node) and not node.meta.get("in_flight_alone"):
            for wait in reversed(waits):
                node.append(wait)
        else:
            in_flight[node] = waits
