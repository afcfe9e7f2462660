"""The verifiers catch what they promise to catch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import passes_of
from transpiler.build import rewrite
from transpiler.errors import VerificationError
from transpiler.graph.bucket_layout import BUCKET_READY
from transpiler.graph.collectives import is_collective
from transpiler.graph.verify import (
    check_bucket_views,
    check_collectives_waited,
    check_cross_rank,
    check_gradient_reductions,
    check_writes_wait_for_the_vote,
)
from transpiler.runtime.process_group import Placement
from transpiler.trace.tracer import trace_step

pytestmark = pytest.mark.quick  # the quick tier: static, 2 s

BATCH = (torch.randn(4, 3), torch.randint(0, 2, (4,)))


def _program(mode="allreduce", world=2, rank=0, widths=(3, 4, 2)):
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*layers)
    traced = trace_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), BATCH)[0].program
    return traced, rewrite(traced, passes_of(mode), Placement(world, rank, "world", False))


def test_unreduced_gradient_is_caught_at_the_end_only():
    traced, _ = _program()
    check_gradient_reductions(traced, False)  # before any reducing pass: fine
    with pytest.raises(VerificationError, match="reaches the optimizer un-reduced"):
        check_gradient_reductions(traced, True)


def test_unwaited_collective_is_caught():
    _, program = _program()
    collective = next(n for n in program.graph.nodes if is_collective(n))
    wait = next(iter(collective.users))
    wait.replace_all_uses_with(collective)
    program.graph.erase_node(wait)
    with pytest.raises(VerificationError, match="exactly one wait_tensor"):
        check_collectives_waited(program, True)


def test_ranks_that_disagree_are_caught_before_anything_runs():
    _, a = _program(widths=(3, 4, 2))
    _, b = _program(widths=(3, 5, 2), rank=1)
    with pytest.raises(VerificationError, match=r"rank 1 issues collective #1 as .*float32\[2, 5\]"):
        check_cross_rank([a, b])


def _adasum_programs(world=4):
    from tests.helpers import strategy_of
    from transpiler.runtime.process_group import subgroup_names

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    traced = trace_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), BATCH)[0].program
    strategy = strategy_of("adasum")
    placement = Placement(world, 0, "world", False)
    groups = subgroup_names(placement, strategy.layout.groups(world))
    programs = []
    for r in range(world):
        p = traced.clone(rank=r)
        p.world_size, p.group_name, p.subgroups = world, "world", dict(groups)
        for each in strategy.variants["step"]:
            each.run(p)
        programs.append(p)
    members = {name: ranks for ranks, name in groups.items()} | {"world": tuple(range(world))}
    return programs, members


def test_send_receive_simulation_accepts_adasum_and_catches_a_wrong_partner():
    from transpiler.graph.p2p import is_exchange
    from transpiler.graph.verify import check_communication

    programs, members = _adasum_programs()
    check_communication(programs, members)  # every exchange pairs up, no deadlock
    first = next(n for n in programs[1].graph.nodes if is_exchange(n))
    first.args = (first.args[0], 3, first.args[2])  # rank 1 now waits for rank 3, which waits for rank 2
    with pytest.raises(VerificationError, match=r"(mismatched exchange|deadlock).*rank 1: exchange with 3"):
        check_communication(programs, members)


def test_send_receive_simulation_catches_a_size_mismatch():
    from transpiler.graph.p2p import is_exchange
    from transpiler.graph.verify import check_communication

    programs, members = _adasum_programs(world=2)
    node = next(n for n in programs[1].graph.nodes if is_exchange(n))
    node.args = (node.args[0], node.args[1], node.args[2] + 1)
    with pytest.raises(VerificationError, match="mismatched exchange"):
        check_communication(programs, members)


def test_bucket_views_that_overlap_or_leave_a_gap_are_caught():
    _, program = _program("fused_allreduce", widths=(3, 4, 4, 2))
    check_bucket_views(program, True)
    ready = next(n for n in program.graph.nodes if n.target is BUCKET_READY)
    buffer = ready.args[0]
    piece = next(u for u in buffer.users if u.target is torch.ops.aten.as_strided.default and u.args[3] > 0)
    piece.args = (*piece.args[:3], piece.args[3] - 1)  # the slot one element early: it overlaps the one before
    with pytest.raises(VerificationError, match="fills"):
        check_bucket_views(program, True)
    ready.args = (buffer, ready.args[1][:-1])
    with pytest.raises(VerificationError, match="fills"):
        check_bucket_views(program, True)


def test_a_bucket_buffer_read_outside_its_views_is_caught():
    _, program = _program("fused_allreduce", widths=(3, 4, 4, 2))
    ready = next(n for n in program.graph.nodes if n.target is BUCKET_READY)
    with program.graph.inserting_after(ready):
        program.graph.call_function(torch.ops.aten.clone.default, (ready.args[0],))
    with pytest.raises(VerificationError, match="not its views"):
        check_bucket_views(program, True)


def test_a_write_into_an_input_before_the_quorum_vote_is_counted_is_caught():
    """A step a quorum votes on (built to be looked at: a world of 2, torchft's group the label ``quorum``): the
    in-place update of ``fused_allreduce`` waits for the vote at ``await_vote``; without that node, its first
    write into an input is named."""
    from transpiler import FaultTolerance, StaticWorld, transpile
    from transpiler.graph.quorum_ops import AWAIT_VOTE

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = nn.CrossEntropyLoss()
    step = transpile(
        model,
        optimizer,
        "fused_allreduce",
        loss,
        BATCH,
        fault_tolerance=FaultTolerance(),
        mesh=StaticWorld(size=2, rank=1),
    )
    program = step.programs["step"]
    check_writes_wait_for_the_vote(program, True)
    program.graph.erase_node(next(n for n in program.graph.nodes if n.target is AWAIT_VOTE))
    check_writes_wait_for_the_vote(program, False)  # between passes: not yet
    with pytest.raises(VerificationError, match="writes into input .* before the quorum's vote is counted"):
        check_writes_wait_for_the_vote(program, True)
