"""The feed's plan of a program's ports (``transpiler/runtime/program_ports.py``): which outputs a program returns
as it was fed them (its update in place), which the write-back then leaves where they are. Quick: about 2 s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transpiler import DiLoCo, transpile
from transpiler.graph.ports import PortKind

pytestmark = pytest.mark.quick


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_an_update_in_place_returns_what_it_was_fed_and_the_step_stays_eager_step_after_step():
    """DiLoCo's inner step (no sync within the run) updates each parameter and its momentum in place: every
    parameter and state output, and nothing else, is marked as its input returned. SGD's momentum buffer does
    not exist before the first step (eager creates it then): the step feeds a fresh one and returns it, and the
    write-back stores it, since the optimizer does not hold it yet. Five steps against eager SGD with momentum
    (foreach), bitwise: parameters, and the momentum buffers the optimizer holds."""
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, foreach=True)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)) for _ in range(5)]
    step = transpile(model, optimizer, DiLoCo(sync_every=1000), loss_fn, batches[0])
    ports = step._state.built.ports["inner"]
    program = step.programs["inner"]
    marked = {port.kind for port, returned in zip(program.outputs, ports.returned) if returned is not None}
    unmarked = {port.kind for port, returned in zip(program.outputs, ports.returned) if returned is None}
    assert marked == {PortKind.PARAM, PortKind.STATE} and unmarked == {PortKind.LOSS}
    for x, y in batches:
        step(x, y)
        eager.zero_grad()
        loss_fn(reference(x), y).backward()
        eager.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
            assert torch.equal(optimizer.state[p]["momentum_buffer"], eager.state[q]["momentum_buffer"])
    assert optimizer.state_dict()["state"].keys() == eager.state_dict()["state"].keys()
