"""The verifiers catch what they promise to catch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transpiler.api import rewrite
from transpiler.collectives import is_collective
from transpiler.errors import VerificationError
from transpiler.modes import build_passes
from transpiler.process_group import Placement
from transpiler.tracing import trace_step
from transpiler.verify import check_collectives_waited, check_cross_rank, check_gradient_reductions

BATCH = (torch.randn(4, 3), torch.randint(0, 2, (4,)))


def _program(mode="allreduce", world=2, rank=0, widths=(3, 4, 2)):
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*layers)
    traced, *_ = trace_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), BATCH)
    return traced, rewrite(traced, build_passes(mode, {}), Placement(world, rank, "world", False))


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
