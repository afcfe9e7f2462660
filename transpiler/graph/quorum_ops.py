"""The graph's points of contact with a torchft quorum: ``transpiler::await_quorum``, ``transpiler::cast_vote``
and ``transpiler::await_vote``.

Under ``fault_tolerance`` the quorum for a step is taken while the step runs (``overlap-quorum``), so the program
itself says where it needs it. ``await_quorum(x, group)`` stands before the first collective on the quorum's
group: it returns ``x`` once that quorum is known and agrees with what the step was computed for, and raises
otherwise, before anything has left this rank for another group. ``cast_vote(waited, group)`` stands after the last
collective's wait: the step can no longer fail for a lost peer, so its commit vote goes out while the rest of the
update computes. ``await_vote(waited, group)`` stands before the first write into the step's inputs (an update in
place): it returns once the vote is counted and raises when the quorum does not commit the step, before anything
is written. Each calls what the runtime registered for ``group`` (:func:`serve`); where nothing is registered
(a program built to be looked at, or run by a test without a quorum) they do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

aten = torch.ops.aten


@dataclass(frozen=True)
class QuorumHooks:
    """What a running quorum does at the program's nodes: ``settle`` waits for the step's quorum and raises
    when it is not the one the step was computed for; ``vote`` starts the commit vote; ``verdict`` waits for the
    vote and raises when the step does not commit."""

    settle: Callable[[], None]
    vote: Callable[[], None]
    verdict: Callable[[], None]


_SERVED: dict[str, QuorumHooks] = {}


def serve(group: str, hooks: QuorumHooks | None) -> None:
    """Register (``None``: drop) what the program's quorum nodes on ``group`` call."""
    if hooks is None:
        _SERVED.pop(group, None)
    else:
        _SERVED[group] = hooks


def _served(tensors: list[torch.Tensor], group: str) -> QuorumHooks | None:
    """What runs the nodes on ``group``: nothing while a pass propagates fake tensors through them."""
    return None if any(is_fake(t) for t in tensors) else _SERVED.get(group)


_lib = torch.library.Library("transpiler", "FRAGMENT")
_lib.define("await_quorum(Tensor(a) x, str group) -> Tensor(a)")
_lib.define("cast_vote(Tensor[] waited, str group) -> ()")
_lib.define("await_vote(Tensor[] waited, str group) -> ()")


@torch.library.impl(_lib, "await_quorum", "CompositeExplicitAutograd")
def _await_quorum(x: torch.Tensor, group: str) -> torch.Tensor:
    hooks = _served([x], group)
    if hooks is not None:
        hooks.settle()
    return aten.alias.default(x)


@torch.library.impl(_lib, "cast_vote", "CompositeExplicitAutograd")
def _cast_vote(waited: list[torch.Tensor], group: str) -> None:
    hooks = _served(waited, group)
    if hooks is not None:
        hooks.vote()


@torch.library.impl(_lib, "await_vote", "CompositeExplicitAutograd")
def _await_vote(waited: list[torch.Tensor], group: str) -> None:
    hooks = _served(waited, group)
    if hooks is not None:
        hooks.verdict()


AWAIT_QUORUM = torch.ops.transpiler.await_quorum.default
CAST_VOTE = torch.ops.transpiler.cast_vote.default
AWAIT_VOTE = torch.ops.transpiler.await_vote.default
for _op in (CAST_VOTE, AWAIT_VOTE):  # nothing reads them: dead-code elimination must keep them
    fx.node.has_side_effect(_op)


def is_quorum_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (AWAIT_QUORUM, CAST_VOTE, AWAIT_VOTE)
