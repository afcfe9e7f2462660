"""``recompute``: fit the step's own tensors in a memory budget by recomputing forward values in the backward.

Requires: a traced step (roles ``forward``/``loss`` before the backward), before any pass that distributes it, so
every mode, ZeRO-3's re-gathers included, sees the recomputed ops as backward ops that read the parameters.
Guarantees: the program's own tensors at their peak, counted by its schedule (``graph/memory.py``), are at most
the budget: ``memory-budget`` times their peak without recompute, or ``memory-budget-bytes``;
``memory-budget=0`` asks for the least this step can reach. A forward value the backward reads is either kept
from the forward, as traced, or recomputed by a copy of the ops that made it, placed right before the backward
first reads it; the copies read kept values, the parameters and the batch. Every recomputed op is one that
gives the same bits again (``recompute_cost.repeatable``: never dropout or another random op, never a
collective), on the same inputs, so the step's values are bitwise those without recompute at every budget.
A budget the step cannot reach is a :class:`~transpiler.errors.ConfigurationError` that names the least it can.

The choice, in the spirit of AOTAutograd's knapsack over the joint graph but judged by the peak of the schedule
itself: the kept values are ranked by what recomputing them costs per byte it frees (``recompute_cost``:
element-wise ops first, matmuls and attention last), and taken one by one while the budget is not met, each
kept out only where the peak, or else what the forward leaves for the backward, goes down. On a residual model
that greedy stalls: a recomputed residual stream chains (each block's copy reads the one before, so the backward
makes them all at once), so the same search also starts from keeping only every s-th cut value of the forward
(the residual stream between blocks, found as the loss's dominators), as checkpointing per block or per sqrt(n)
blocks would, and the cheapest start that fits wins. A model that checkpoints itself (``torch.utils.checkpoint``)
recomputes in its traced backward; with a budget, those copies are first merged back into the forward values
they repeat, and this pass decides again.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.memory import FORWARD_ROLES, Liveness, Slot, liveness, slots_of
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.ports import PortKind, is_input
from transpiler.graph.program import StepProgram

from .recompute_cost import recompute_seconds, repeatable

MIB = 1024 * 1024


@dataclass(frozen=True)
class Recompute(Pass):
    name = "recompute"
    summary = "recompute forward values in the backward until the step's own tensors fit a memory budget"
    memory_budget: float = option(
        1.0,
        minimum=0.0,
        maximum=1.0,
        help="the step's own peak bytes, as a fraction of those without recompute (0: the least it can reach)",
    )
    memory_budget_bytes: int = option(0, minimum=0, help="the step's own peak bytes, in bytes (0: use memory_budget)")

    def run(self, program: StepProgram) -> bool:
        graph = program.graph
        if any("recomputed_from" in n.meta for n in graph.nodes):
            return False
        if self.memory_budget >= 1.0 and not self.memory_budget_bytes:
            return False
        merged = merge_recomputation(graph)
        plan = RecomputePlan(list(graph.nodes), program.op_scratch)
        target = self.memory_budget_bytes or math.floor(self.memory_budget * plan.baseline.peak)
        chosen, reached = plan.choose(target)
        if reached.peak > target and (self.memory_budget > 0 or self.memory_budget_bytes):
            raise ConfigurationError(
                f"the step's own tensors cannot fit {_mib(target)} by recompute: the least they reach is "
                f"{_mib(reached.peak)} ({reached.peak / max(plan.baseline.peak, 1):.2f} of {_mib(plan.baseline.peak)} "
                "without recompute). Raise the budget, give memory_budget=0 for that least, or shard more (zero3, a "
                "tensor-parallel plan)."
            )
        copies = plan.rewrite(graph, chosen)
        program.decisions["recompute"] = (
            f"budget {_mib(target)}: recomputes {copies} ops in the backward ({len(chosen)} forward values "
            f"not kept{f', {merged} of the model checkpoint copies merged back first' if merged else ''}); "
            f"peak of the step's own tensors {_mib(plan.baseline.peak)} -> {_mib(reached.peak)}, kept for the "
            f"backward {_mib(plan.baseline.after_forward)} -> {_mib(reached.after_forward)}"
        )
        program.recompile()
        return bool(copies or merged)


def _mib(size: int) -> str:
    return f"{size / MIB:.3f} MiB"


class RecomputePlan:
    """A traced step's schedule, and the forward values it could recompute instead of keeping."""

    def __init__(self, nodes: list[fx.Node], scratch: dict[str, int] | None = None) -> None:
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        self.slots = slots_of(nodes, scratch=scratch)
        self.forward_end = max((i for i, n in enumerate(nodes) if n.meta.get("role") in FORWARD_ROLES), default=-1)
        self.baseline = liveness(self.slots)
        self.groups = self._candidates()

    def _root(self, i: int) -> int | None:
        while self.slots[i].alias is not None:
            i = self.slots[i].alias
        return i if self.slots[i].size else None

    def _candidates(self) -> list[tuple[int, ...]]:
        """Each forward allocation the backward reads (itself or through a view), with its views and the
        forward-only values it is made from (:meth:`_made_from`): the units kept or recomputed together, dearest
        per byte last. One read by the output, or made by an op that may not run again, is kept."""
        members: dict[int, list[int]] = {}
        for i in range(self.forward_end + 1):
            root = self._root(i) if self.nodes[i].op == "call_function" else None
            if root is not None:
                members.setdefault(root, []).append(i)
        for root, group in members.items():  # one output of several: recomputed by its op, all outputs at once
            if self.nodes[root].target is operator.getitem:
                group.insert(0, self.index[self.nodes[root].args[0]])
        read_late = {
            i for i in range(self.forward_end + 1) if any(self.index[u] > self.forward_end for u in self.nodes[i].users)
        }
        groups = []
        for root, group in members.items():
            readers = [u for i in group for u in self.nodes[i].users]
            if not any(self.index[u] > self.forward_end for u in readers):
                continue  # dies in the forward
            if any(u.op == "output" for u in readers) or not all(repeatable(self.nodes[i]) for i in group):
                continue
            unit = self._made_from(group, read_late)
            cost = sum(recompute_seconds(self.nodes[i]) for i in unit)
            groups.append((cost / self.slots[root].size, tuple(sorted(unit))))
        groups.sort(key=lambda pair: pair[0])
        return [group for _, group in groups]

    def _made_from(self, group: list[int], read_late: set[int]) -> set[int]:
        """``group`` and the forward values it is made from that the backward does not read: recomputing the
        group alone would keep those alive for its copy instead, and free nothing (a residual ``add`` reads a
        projection the forward drops at once). The walk stops at values the backward reads anyway, at the
        step's inputs, and at ops that may not run again (their outputs are kept)."""
        unit, stack = set(group), list(group)
        while stack:
            for value in self.nodes[stack.pop()].all_input_nodes:
                j = self.index[value]
                if value.op != "call_function" or j in unit or j in read_late or not repeatable(value):
                    continue
                unit.add(j)
                stack.append(j)
        return unit

    def choose(self, target: int) -> tuple[frozenset[int], Liveness]:
        """The forward ops to recompute (positions) and the liveness that gives: the best of several searches
        (:meth:`search`), each from its own start. The first starts with every value kept; the others keep
        only every s-th cut value of the forward (:meth:`cut_groups`: the block boundaries, s = 1, 2, 4, ...) and
        recompute the rest, as checkpointing per block or every sqrt(n) blocks would: of those, the two whose
        start has the lowest peak (a search costs a schedule per group; on the bench's models the winner was
        always among them). The best fits the target at the least recompute cost, or, where none fits, reaches
        the lowest peak."""
        cuts = self.cut_groups()
        strided = []
        stride = 1
        while stride <= len(cuts):
            kept = set(cuts[::stride])
            strided.append([g for g in self.groups if g not in kept])
            stride *= 2
        strided.sort(key=lambda start: self.outcome(start).peak)
        found = [self.search(start, target) for start in [[], *strided[:2]]]

        def rank(pair: tuple[list[tuple[int, ...]], Liveness]) -> tuple:
            taken, reached = pair
            cost = sum(map(self.cost, taken))
            return (0, 0, cost) if reached.peak <= target else (1, reached.peak, cost)

        taken, reached = min(found, key=rank)
        return frozenset(i for g in taken for i in g), reached

    def search(self, start: list[tuple[int, ...]], target: int) -> tuple[list[tuple[int, ...]], Liveness]:
        """From the groups ``start`` recomputes, greedily: each other group in rank order is left unkept where that
        lowers the peak, or the bytes the forward leaves for the backward at the same peak, until the peak is at
        most ``target``. Then the groups taken are tried again, dearest first, and kept after all where the peak
        stays within the target (or the least reached): a group that only helped on the way there, or that the
        start took, costs time for nothing."""
        taken, started = list(start), set(start)
        best = self.outcome(taken)
        for group in self.groups:
            if best.peak <= target:
                break
            if group in started:
                continue
            outcome = self.outcome(taken + [group])
            if (outcome.peak, outcome.after_forward) < (best.peak, best.after_forward):
                taken, best = taken + [group], outcome
        bound = max(target, best.peak)
        for group in sorted(taken, key=self.cost, reverse=True):
            rest = [g for g in taken if g is not group]
            outcome = self.outcome(rest)
            if outcome.peak <= bound:
                taken, best = rest, outcome
        return taken, best

    def cut_groups(self) -> list[tuple[int, ...]]:
        """The groups holding a cut value of the forward, in forward order: one that every path from a batch input
        to the loss runs through (a dominator of the loss), such as the residual stream between two blocks. Kept,
        such values hold the recomputation of what lies between them to one segment at a time."""
        flow = nx.DiGraph()
        sources = []
        for i in range(self.forward_end + 1):
            node = self.nodes[i]
            if is_input(node, PortKind.BATCH):
                sources.append(i)
            flow.add_edges_from((self.index[a], i) for a in node.all_input_nodes)
            if node.meta.get("role") == "loss":
                flow.add_edge(i, "loss")
        cuts: set[int] = set()
        for source in sources:  # per input: the label reaches the loss by a path of its own
            dominator = nx.immediate_dominators(flow, source) if source in flow else {}
            at = dominator.get("loss", source)
            while at != source:
                cuts.add(at)
                at = dominator[at]
        return sorted((g for g in self.groups if cuts.intersection(g)), key=max)

    def outcome(self, groups: list[tuple[int, ...]]) -> Liveness:
        """The liveness of the step with ``groups`` recomputed."""
        return liveness(self.schedule(frozenset(i for g in groups for i in g)))

    def cost(self, group: tuple[int, ...]) -> float:
        return sum(recompute_seconds(self.nodes[i]) for i in group)

    def placements(self, chosen: frozenset[int]) -> dict[int, int]:
        """Where each recomputed op's copy goes: right before the first op after the forward that reads it, or
        reads a copy that needs it (positions in the traced order). An op no later op needs gets no copy."""
        place: dict[int, int] = {}
        for i in sorted(chosen, reverse=True):  # readers come after what they read
            later = [self.index[u] for u in self.nodes[i].users if self.index[u] > self.forward_end]
            later += [place[self.index[u]] for u in self.nodes[i].users if self.index[u] in place]
            if later:
                place[i] = min(later)
        for i in list(place):  # an output of several right after its op's copy: the tuple dies at once
            node = self.nodes[i]
            if node.target is operator.getitem and self.index[node.args[0]] in place:
                place[i] = place[self.index[node.args[0]]]
        return place

    def schedule(self, chosen: frozenset[int]) -> list[Slot]:
        """The slots of the step with ``chosen`` recomputed, each copy where :meth:`placements` puts it."""
        place = self.placements(chosen)
        before: dict[int, list[int]] = {}
        for i, at in sorted(place.items()):
            before.setdefault(at, []).append(i)
        first = min(before, default=len(self.slots))  # the slots before the first copy stay as they are
        early = list(range(first)) + [0] * (len(self.slots) - first)  # where an op now sits, as the forward reads it
        late = list(early)  # ... and as the backward and the copies read it: its copy, if it has one
        slots: list[Slot] = self.slots[:first]
        for i, slot in enumerate(self.slots[first:], first):
            for c in before.get(i, ()):
                s = self.slots[c]
                late[c] = len(slots)
                alias = None if s.alias is None else late[s.alias]
                slots.append(Slot(tuple(map(late.__getitem__, s.reads)), alias, s.size, "recompute", s.scratch))
            where = late if i > self.forward_end else early
            early[i] = late[i] = len(slots)
            alias = None if slot.alias is None else where[slot.alias]
            slots.append(Slot(tuple(map(where.__getitem__, slot.reads)), alias, slot.size, slot.role, slot.scratch))
        return slots

    def rewrite(self, graph: fx.Graph, chosen: frozenset[int]) -> int:
        """Put the copies of ``chosen`` into ``graph`` and have every later reader read them; the originals only
        the backward read are then dead and go. Returns how many copies it made."""
        place = self.placements(chosen)
        copies: dict[fx.Node, fx.Node] = {}
        for i, at in sorted(place.items()):  # forward order: a copy's inputs are copied before it
            original = self.nodes[i]
            with graph.inserting_before(self.nodes[at]):
                copy = graph.node_copy(original, lambda n: copies.get(n, n))
            copy.meta.update(original.meta)
            copy.meta["role"] = "backward"
            copy.meta["recomputed_from"] = original.name
            copies[original] = copy
        made = set(copies.values())
        for original, copy in copies.items():
            for user in list(original.users):
                if user not in made and self.index[user] > self.forward_end:
                    user.replace_input_with(original, copy)
        graph.eliminate_dead_code()
        return len(copies)


def merge_recomputation(graph: fx.Graph) -> int:
    """Replace every op after the forward that repeats a forward op on the same inputs (a model's own
    ``torch.utils.checkpoint``, traced) by that forward op's value; returns how many it merged."""
    nodes = list(graph.nodes)
    forward_end = max((i for i, n in enumerate(nodes) if n.meta.get("role") in FORWARD_ROLES), default=-1)
    seen: dict[tuple, fx.Node] = {}
    merged = 0
    for i, node in enumerate(nodes):
        if not repeatable(node):
            continue
        key = (node.target, _frozen(node.args), _frozen(node.kwargs))
        if i <= forward_end:
            seen.setdefault(key, node)
        elif key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
    return merged


def _frozen(value: object) -> object:
    """``value`` as a hashable key (nodes stand for themselves)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (fx.Node, int, bool, str, type(None))):
        return (type(value).__name__, value)
    return (type(value).__name__, repr(value))
