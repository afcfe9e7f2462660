"""``overlap-quorum``: under a torchft quorum, cast the step's commit vote where the step can no longer fail for a
lost peer, and (``wait``) wait for a quorum taken beside the step where the step first needs it.

Requires: a functional step whose sums across replica groups run on the quorum's process group: the program's
group (a group of one rank), or its axis ``across`` (a group of several ranks, which reduces in two levels).
Guarantees: ``transpiler::cast_vote`` right after the last wait of any collective, so the vote overlaps what the
update still computes; with ``wait``, ``transpiler::await_quorum`` on the input of the first collective on that
group, so that the forward, the backward and every collective inside the group run while the quorum is taken,
and nothing leaves for another group before it is known. Both are ``role=communication`` and change no value: the
arithmetic, and with it every bitwise claim of the mode, stays as it was. The runtime decides what they do
(``transpiler/runtime/quorum.py``); a dump shows where the step blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import is_collective, is_wait
from transpiler.graph.edit import emit
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram
from transpiler.graph.quorum_ops import AWAIT_QUORUM, CAST_VOTE, is_quorum_node


@dataclass(frozen=True)
class OverlapQuorum(Pass):
    name = "overlap-quorum"
    summary = "cast the torchft vote after the last wait; wait for the quorum at the first collective across groups"
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
            emit(graph, CAST_VOTE, ([last], group), role="communication")
        return True
