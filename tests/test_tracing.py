"""The traced step, run at world size 1, is bitwise the eager training step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.tiny_models import MLP, SmallCNN, TiedLM, make_batch
from tests.helpers import assert_same_training_state, eager_step, eager_twin
from transpiler import StaticWorld, mode_config, transpile

pytestmark = pytest.mark.bitwise  # claims eager's or DDP's bits: run again under narrower kernels in .ci/run

OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
    "sgd_nesterov_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.8, nesterov=True),
    "sgd_dampening_maximize": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.5, dampening=0.3, maximize=True
    ),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "adam_amsgrad_wd": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01, amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05),
}


def _train_both(model_name, make_opt, mode="none", steps=5, **options):
    torch.manual_seed(0)
    model = {"mlp": MLP, "cnn": SmallCNN, "tied": TiedLM}[model_name]()
    twin, twin_opt = eager_twin(model, make_opt)
    opt = make_opt(model)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    batches = [make_batch(model_name, 16, gen) for _ in range(steps)]
    step = transpile(model, opt, mode_config(mode, **options), loss_fn=loss_fn, example_inputs=batches[0])
    for batch in batches:
        loss = step(*batch)
        assert torch.equal(loss, eager_step(twin, twin_opt, loss_fn, batch))
    return model, opt, twin, twin_opt, step


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", ["mlp", "cnn", "tied"])
def test_no_passes_is_bitwise_eager(model_name, opt_name):
    model, opt, twin, twin_opt, _ = _train_both(model_name, OPTIMIZERS[opt_name])
    assert_same_training_state(model, opt, twin, twin_opt)


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["allreduce", "fused_allreduce"])
def test_every_mode_is_bitwise_eager_at_world_size_one(mode):
    """At world size 1 the collectives run on a private one-rank gloo group: identities."""
    model, opt, twin, twin_opt, step = _train_both("cnn", OPTIMIZERS["adam"], mode=mode)
    assert_same_training_state(model, opt, twin, twin_opt)
    assert any("collective" in n.meta for n in step.graph_module.graph.nodes)


def test_param_groups_and_lr_scheduler():
    torch.manual_seed(0)
    model = MLP()

    def make_opt(m):
        return torch.optim.SGD(
            [
                {"params": m.net[0].parameters(), "lr": 0.1},
                {"params": list(m.net[2].parameters()) + list(m.net[4].parameters())},
            ],
            lr=0.01,
            momentum=0.9,
        )

    twin, twin_opt = eager_twin(model, make_opt)
    opt = make_opt(model)
    sched, twin_sched = (torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, twin_opt))
    gen = torch.Generator().manual_seed(3)
    batches = [make_batch("mlp", 8, gen) for _ in range(6)]
    step = transpile(model, opt, "fused_allreduce", loss_fn=nn.CrossEntropyLoss(), example_inputs=batches[0])
    for batch in batches:
        step(*batch)
        eager_step(twin, twin_opt, nn.CrossEntropyLoss(), batch)
        sched.step()
        twin_sched.step()
    assert_same_training_state(model, opt, twin, twin_opt)


@pytest.mark.quick
def test_roles_and_gradient_tags():
    torch.manual_seed(0)
    model = TiedLM()
    step = transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        "none",
        loss_fn=nn.CrossEntropyLoss(),
        example_inputs=make_batch("tied", 4, torch.Generator().manual_seed(0)),
    )
    graph = step.graph_module.graph
    roles = [n.meta.get("role") for n in graph.nodes if n.op == "call_function"]
    assert set(roles) == {"forward", "loss", "loss_grad", "backward", "optimizer"}
    assert roles.count("loss_grad") == 1
    first = {r: roles.index(r) for r in set(roles)}  # roles appear in step order
    assert first["forward"] < first["loss"] < first["loss_grad"] < first["backward"] < first["optimizer"]
    grads = sorted(n.meta["grad_of"] for n in graph.nodes if "grad_of" in n.meta)
    assert grads == ["embed.weight", "proj.bias"]  # tied weight once, frozen parameter none


class WithUnused(nn.Module):
    """One layer never used in forward: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


def test_unused_parameter_is_left_alone_like_eager():
    torch.manual_seed(0)
    model = WithUnused()
    twin, twin_opt = eager_twin(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    step = transpile(model, opt, "allreduce", loss_fn=nn.CrossEntropyLoss(), example_inputs=batch)
    step(*batch)
    eager_step(twin, twin_opt, nn.CrossEntropyLoss(), batch)
    assert_same_training_state(model, opt, twin, twin_opt)
    assert all("unused" not in n.meta.get("grad_of", "") for n in step.graph_module.graph.nodes)


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["local_sgd", "adasum_delta", "fused_allreduce"])
def test_unused_parameter_in_every_family(mode):
    """An unused parameter's new value is its input: passes must insert after all inputs, not among them."""

    torch.manual_seed(0)
    model = WithUnused()
    before = model.unused.weight.detach().clone()
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), mode, loss_fn=nn.CrossEntropyLoss())
    for _ in range(2):
        step(*batch)
    assert torch.equal(model.unused.weight, before)
    transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mode,
        loss_fn=nn.CrossEntropyLoss(),
        example_inputs=batch,
        mesh=StaticWorld(size=4),
    )  # the static multi-rank build verifies too


@pytest.mark.quick
def test_model_returning_its_own_loss_and_new_batch_shapes():
    class SelfLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x, y):
            return ((self.lin(x).squeeze(1) - y) ** 2).mean()

    torch.manual_seed(0)
    model = SelfLoss()
    twin, twin_opt = eager_twin(model, lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = transpile(model, opt, "fused_allreduce", loss_fn=None)
    for n in (8, 8, 5):  # the last, smaller batch is traced again
        x, y = torch.randn(n, 3), torch.randn(n)
        assert torch.equal(step(x, y), twin(x, y).detach())
        twin_opt.zero_grad()
        twin(x, y).backward()
        twin_opt.step()
    assert_same_training_state(model, opt, twin, twin_opt)


@pytest.mark.quick
def test_state_dict_round_trip():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = make_batch("mlp", 8, torch.Generator().manual_seed(0))
    step = transpile(model, opt, "fused_allreduce", loss_fn=nn.CrossEntropyLoss(), example_inputs=batch)
    step(*batch)
    saved = step.state_dict()
    after_one = [p.detach().clone() for p in model.parameters()]
    step(*batch)
    step.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_one))
    assert float(opt.state[next(model.parameters())]["step"]) == 1.0
