"""Any torch.optim optimizer (and a user's own) through its own traced ``step()``, at world size 1.

Each trains 5 steps through ``transpile(mode="none")`` against eager ``optimizer.step()`` from the same
weights and batches, with non-default options where they change the code path, under an LR scheduler.
Bitwise where the traced step runs the optimizer's own default path (the Python arithmetic on the step
count and lr is recorded and re-run in doubles); RAdam and ASGD take their capturable (tensor) forms,
because their default paths branch on the step count or on ``mu``, so they are compared within
``TENSOR_PATH_TOL``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.tiny_models import Lion, muon_and_adamw
from transpiler import ConfigurationError, StaticWorld, UnsupportedOptimizerError, transpile

pytestmark = pytest.mark.bitwise  # claims eager's or DDP's bits: run again under narrower kernels in .ci/run

TENSOR_PATH_TOL = 1e-6  # float32 tensor arithmetic (RAdam's rectification, ASGD's eta and mu), not Python doubles


OPTIMIZERS = {
    "RMSprop centered momentum": lambda p: torch.optim.RMSprop(
        p, lr=0.01, momentum=0.5, centered=True, weight_decay=0.01
    ),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "Adagrad lr_decay": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, weight_decay=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01, weight_decay=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "NAdam decoupled": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.01),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=2, weight_decay=0.01),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "Adam amsgrad subclass": lambda p: type("MyAdam", (torch.optim.Adam,), {})(p, lr=0.01, amsgrad=True),
    "Lion (custom)": lambda p: Lion(p, lr=0.01, weight_decay=0.1),
    "Muon + AdamW (chained)": muon_and_adamw,
}
TOLERANT = {"RAdam", "ASGD"}
SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10, cycle_momentum=False),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(n: int = 5) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_eager_step_after_step(name, scheduler):
    ours, eager = _model(), _model()
    ours_opt, eager_opt = OPTIMIZERS[name](ours.parameters()), OPTIMIZERS[name](eager.parameters())
    ours_sched, eager_sched = SCHEDULERS[scheduler](ours_opt), SCHEDULERS[scheduler](eager_opt)
    step = transpile(ours, ours_opt, "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    for i, (x, y) in enumerate(_batches()):
        assert ours_opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"]  # the lr this step uses
        step(x, y)
        eager_opt.zero_grad()
        nn.functional.cross_entropy(eager(x), y).backward()
        eager_opt.step()
        ours_sched.step()
        eager_sched.step()
        for (n, a), b in zip(ours.named_parameters(), eager.parameters()):
            if name in TOLERANT:
                torch.testing.assert_close(a, b, atol=TENSOR_PATH_TOL, rtol=0, msg=f"{name} step {i} {n}")
            else:
                assert torch.equal(a, b), f"{name} with {scheduler}: step {i} {n} differs"
    for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):  # optimizer.state as eager's
        mine, theirs = ours_opt.state[p_ours], eager_opt.state[p_eager]
        assert mine.keys() == theirs.keys()
        for key in theirs:
            a, b = torch.as_tensor(mine[key]), torch.as_tensor(theirs[key])
            if name in TOLERANT and a.is_floating_point():
                torch.testing.assert_close(a, b, atol=TENSOR_PATH_TOL, rtol=0, msg=f"{name} state {key}")
            else:
                assert torch.equal(a, b), f"{name} with {scheduler}: optimizer state {key} differs"
    assert step.traces <= 2  # a first step that creates state is traced again once, with it; then never


def test_a_changed_hyper_parameter_other_than_lr_is_an_error():
    model = _model()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)
    step = transpile(model, opt, "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    x, y = _batches(1)[0]
    step(x, y)
    step(x, y)  # the program that reads the state
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(UnsupportedOptimizerError, match=r"changed \['momentum'\].*cycle_momentum=False"):
        step(x, y)


def test_state_dict_round_trip_resumes_bitwise():
    batches = _batches(6)
    model = _model()
    opt = torch.optim.NAdam(model.parameters(), lr=0.01)
    step = transpile(model, opt, "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    for x, y in batches[:3]:
        step(x, y)
    checkpoint = step.state_dict()
    for x, y in batches[3:]:
        step(x, y)
    resumed_model = _model()
    resumed_opt = torch.optim.NAdam(resumed_model.parameters(), lr=0.01)
    resumed = transpile(resumed_model, resumed_opt, "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    resumed.load_state_dict(checkpoint)
    for x, y in batches[3:]:
        resumed(x, y)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_muon_on_a_model_of_matrices_matches_eager():
    """Muon takes 2-D parameters only; torch pairs it with another optimizer for the rest, which transpile()
    (one optimizer) cannot take yet, so the model here has matrices only."""

    def matrices() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))

    ours, eager = matrices(), matrices()
    ours_opt, eager_opt = torch.optim.Muon(ours.parameters(), lr=0.02), torch.optim.Muon(eager.parameters(), lr=0.02)
    step = transpile(ours, ours_opt, "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    for x, y in _batches():
        step(x, y)
        eager_opt.zero_grad()
        nn.functional.cross_entropy(eager(x), y).backward()
        eager_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), eager.parameters()))


def test_a_list_of_optimizers_steps_as_one_and_each_keeps_its_own_state_and_scheduler():
    """transpile(model, [muon, adamw]): each member's scheduler sets its own lr, each member's state_dict()
    holds only its parameters, and step.state_dict() resumes bitwise."""
    batches = _batches(6)

    def members(model: nn.Module) -> list:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2])]

    ours, eager = _model(), _model()
    ours_opts, eager_opts = members(ours), members(eager)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in ours_opts + eager_opts]
    step = transpile(ours, ours_opts, "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    for x, y in batches[:3]:
        step(x, y)
        for o in eager_opts:
            o.zero_grad()
        nn.functional.cross_entropy(eager(x), y).backward()
        for o in eager_opts:
            o.step()
        for s in schedules:
            s.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), eager.parameters()))
    assert [len(o.state_dict()["state"]) for o in ours_opts] == [2, 2]
    checkpoint = step.state_dict()
    for x, y in batches[3:]:
        step(x, y)
    again = _model()
    resumed = transpile(again, members(again), "none", nn.CrossEntropyLoss(), mesh=StaticWorld(size=1, rank=0))
    resumed.load_state_dict(checkpoint)
    for x, y in batches[3:]:
        resumed(x, y)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), again.parameters()))


def test_a_parameter_in_two_optimizers_is_refused():
    model = _model()
    with pytest.raises(ConfigurationError, match="in two of the optimizers"):
        transpile(model, [torch.optim.Adam(model.parameters()), torch.optim.RMSprop(model.parameters())], "none")
