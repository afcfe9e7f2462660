"""``overlap-quorum``: under a torchft quorum, cast the step's commit vote where the step can no longer fail for a
lost peer, wait for its count before the step writes into its inputs, and (``wait``) wait for a quorum taken
beside the step where the step first needs it.

Requires: a step whose sums across replica groups run on the quorum's process group: the program's group (a
group of one rank), or its axis ``across`` (a group of several ranks, which reduces in two levels); its update
functional, or in place (``flatten-update``, ``reinplace-optimizer``) with nothing a collective needs written.
Guarantees: ``transpiler::cast_vote`` right after the last wait of any collective; where the step writes into its
inputs, every write moved after it (with what it needs that no collective needs) and ``transpiler::await_vote``
before the first, so that a step the quorum does not commit stops there, leaving every input as it was (a
functional update instead computes while the vote is counted); with ``wait``, ``transpiler::await_quorum`` on
the input of the first collective on that group, so that the forward, the backward and every collective inside
the group run while the quorum is taken, and nothing leaves for another group before it is known. A write that a
collective needs (a ZeRO shard, all-gathered once updated) is refused with a ConfigurationError: such a mode's
update stays functional under a quorum (``Strategy.under_quorum``). The nodes are ``role=communication`` and
change no value: the arithmetic, and with it every bitwise claim of the mode, stays as it was. The runtime
decides what they do (``transpiler/runtime/quorum.py``); a dump shows where the step blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import is_collective, is_wait
from transpiler.graph.edit import ancestors, emit
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram
from transpiler.graph.quorum_ops import AWAIT_QUORUM, AWAIT_VOTE, CAST_VOTE, is_quorum_node
from transpiler.graph.views import viewed_root, written_input


@dataclass(frozen=True)
class OverlapQuorum(Pass):
    name = "overlap-quorum"
    requires = frozenset()  # a functional update or one in place (whose writes it holds back until the vote)
    summary = (
        "cast the torchft vote after the last wait and await it before the first write in place; wait for the "
        "quorum at the first collective across groups"
    )
    wait: bool = option(False, help="wait at the first collective across groups for a quorum taken beside the step")

    def run(self, program: StepProgram) -> bool:
        graph = program.graph
        if any(is_quorum_node(n) for n in graph.nodes):
            return False
        group = program.axes["across"].group_name if "across" in program.axes else program.group_name
        first = next((n for n in graph.nodes if is_collective(n) and n.args[-1] == group), None)
        if first is None:
            raise ConfigurationError(
                f"overlap-quorum: this program has no collective on the quorum's group '{group}', so nothing in it "
                "waits for the quorum. It belongs after the pass that sums across replica groups."
            )
        if self.wait:
            with graph.inserting_before(first):
                awaited = emit(graph, AWAIT_QUORUM, (first.args[0], group), role="communication")
            first.update_arg(0, awaited)
        last = [n for n in graph.nodes if is_wait(n)][-1]
        with graph.inserting_after(last):
            vote = emit(graph, CAST_VOTE, ([last], group), role="communication")
        written = _held_back(graph, vote)
        if written is not None:
            with graph.inserting_before(written):
                emit(graph, AWAIT_VOTE, ([last], group), role="communication")
        return True


def _held_back(graph: fx.Graph, vote: fx.Node) -> fx.Node | None:
    """Move every write into an input, and what it needs that no collective needs, after ``vote``; the first
    write (None: the update writes new tensors). A write a collective needs (a ZeRO shard, all-gathered once
    updated), or one that a node the collectives need read afterwards, is refused."""
    nodes = list(graph.nodes)
    place = {n: i for i, n in enumerate(nodes)}
    writes = [n for n in nodes if written_input(n) is not None]
    if not writes:
        return None
    needed = ancestors([n for n in nodes if is_collective(n) or is_wait(n)], ordered=True)
    span = nodes[place[writes[0]] : place[vote]]
    moving = [n for n in span if n not in needed]
    roots = {written_input(n) for n in moving} - {None}
    blocking = [n.name for n in span if n in needed and (written_input(n) is not None or _reads(n) & roots)]
    if blocking:
        raise ConfigurationError(
            f"overlap-quorum: {blocking[:3]} must run before the step's last collective and write into its inputs, "
            "or read what the update writes, so a step the quorum does not commit would have changed them. Under a "
            "quorum leave out 'reinplace-optimizer' and 'flatten-update' for this mode: its update then writes "
            "new tensors."
        )
    for node in reversed(moving):
        vote.append(node)
    return writes[0]  # still the first: the writes before the vote move in order, those after it stay


def _reads(node: fx.Node) -> set[fx.Node | None]:
    return {viewed_root(value) for value in node.all_input_nodes}
