"""Ordinary things users do between steps either work (bitwise eager) or fail loudly, at world size 1.

Multi-rank cases (handshake, timeouts, checkpoints per rank) are in tests/test_safety_world.py.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from bench.tiny_models import MLP, DropoutBN, make_batch
from tests.helpers import assert_same_training_state, eager_step, eager_twin
from transpiler import (
    CheckpointError,
    ConfigurationError,
    Execution,
    LocalSGD,
    StaticWorld,
    UnsupportedOptimizerError,
    mode_config,
    transpile,
)
from transpiler.cli import main as cli_main
from transpiler.errors import RetraceWarning

pytestmark = pytest.mark.bitwise  # claims eager's or DDP's bits: run again under narrower kernels in .ci/run

LOSS = nn.CrossEntropyLoss()


def _sgd(m):
    return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _pair(model_cls=DropoutBN, make_opt=_sgd, **settings):
    torch.manual_seed(0)
    model = model_cls()
    twin, twin_opt = eager_twin(model, make_opt)
    opt = make_opt(model)
    step = transpile(model, opt, "fused_allreduce", loss_fn=LOSS, execution=Execution(**settings))
    return model, opt, step, twin, twin_opt


def _steps(step, twin, twin_opt, n=3, seed=0, batch_size=8):
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        batch = make_batch("mlp", batch_size, gen)
        torch.manual_seed(seed * 100 + i)
        ours = step(*batch)
        torch.manual_seed(seed * 100 + i)
        assert torch.equal(ours, eager_step(twin, twin_opt, LOSS, batch))


@pytest.mark.quick
def test_train_eval_switches_follow_the_model():
    """Transpiled in eval() (as from_pretrained returns models), then trained: dropout and BN statistics are live."""
    model, opt, step, twin, twin_opt = _pair()
    model.eval(), twin.eval()
    _steps(step, twin, twin_opt, seed=1)  # eval: BN statistics frozen, no dropout
    model.train(), twin.train()
    _steps(step, twin, twin_opt, seed=2)
    model.eval(), twin.eval()
    _steps(step, twin, twin_opt, seed=3)
    assert_same_training_state(model, opt, twin, twin_opt)
    assert step.traces == 2  # one program per set of module modes, then cached


def test_freeze_unfreeze_and_add_param_group():
    model, opt, step, twin, twin_opt = _pair(MLP)
    _steps(step, twin, twin_opt, seed=1)
    frozen = model.net[0].weight.detach().clone()
    for m in (model, twin):
        m.net[0].requires_grad_(False)
    _steps(step, twin, twin_opt, seed=2)
    assert torch.equal(model.net[0].weight, frozen)  # frozen means untouched, momentum or not
    for m in (model, twin):
        m.net[0].requires_grad_(True)
    _steps(step, twin, twin_opt, seed=3)
    assert not torch.equal(model.net[0].weight, frozen)
    assert_same_training_state(model, opt, twin, twin_opt)


def test_add_param_group_trains_the_new_group():
    torch.manual_seed(0)
    model = MLP()
    model.net[4].requires_grad_(False)
    twin, twin_opt = eager_twin(model, _sgd)
    opt = _sgd(model)
    step = transpile(model, opt, loss_fn=LOSS)
    _steps(step, twin, twin_opt, seed=1)
    for m, o in ((model, opt), (twin, twin_opt)):
        m.net[4].requires_grad_(True)
        o.add_param_group({"params": list(m.net[4].parameters()), "lr": 0.01})
    _steps(step, twin, twin_opt, seed=2)
    assert_same_training_state(model, opt, twin, twin_opt)


def test_replaced_submodule_is_a_clear_error():
    model, opt, step, *_ = _pair(MLP)
    step(*make_batch("mlp", 8, None))
    model.net[4] = nn.Linear(32, 5)
    with pytest.raises(UnsupportedOptimizerError, match=r"\(5, 32\) that is not a parameter.*replaced"):
        step(*make_batch("mlp", 8, None))


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_step_under_no_grad_or_inference_mode(context):
    model, opt, step, twin, twin_opt = _pair(MLP)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        batch = make_batch("mlp", 8, gen)
        with context():
            ours = step(*batch)
        assert torch.equal(ours, eager_step(twin, twin_opt, LOSS, batch))
    assert_same_training_state(model, opt, twin, twin_opt)
    model(batch[0]).sum().backward()  # the parameters are ordinary tensors afterwards, not inference tensors


@pytest.mark.quick
@pytest.mark.parametrize(
    "mode, options, message",
    [
        ("local_sgd", {"k_steps": 2.7}, "k_steps.*wants an int >= 1; got 2.7"),
        ("local_sgd", {"k_steps": 0}, "k_steps.*too small"),
        ("local_sgd", {"k_steps": True}, "k_steps.*a bool"),
        ("local_sgd", {"average_state": "maybe"}, "average_state.*true or false"),
        ("local_sgd", {"average_state": 1}, "average_state.*a bool"),
        ("fused_allreduce", {"bucket_cap_mb": -1}, "bucket_cap_mb.*too small"),
        ("fused_allreduce", {"bucket_cap_mb": math.nan}, "bucket_cap_mb.*not finite"),
        ("fused_allreduce", {"bucket_cap_mb": "abc"}, "bucket_cap_mb.*wants a finite float >= 0 or 'auto'; got 'abc'"),
        ("adasum", {"local_size": 0}, "local_size.*too small"),
        ("adasum", {"local_size": 1.5}, "local_size.*wants an int"),
    ],
)
def test_options_are_typed_strictly(mode, options, message):
    model = MLP()
    with pytest.raises(ConfigurationError, match=message):
        transpile(model, _sgd(model), mode_config(mode, **options), loss_fn=LOSS)


def test_option_text_parses_as_its_type():
    model = MLP()
    step = transpile(model, _sgd(model), LocalSGD(adaptive=False, average_state="false", k_steps="3"), loss_fn=LOSS)
    assert step.schedule.k_steps == 3
    assert "average-state" not in step.mode_specs["sync"]
    step = transpile(model, _sgd(model), LocalSGD(adaptive=False, average_state="true"), loss_fn=LOSS)
    assert "average-state=true" in step.mode_specs["sync"]


def test_cli_options_are_typed_the_same_way(capsys):
    assert cli_main(["dump", "bench/tiny_models.py:tiny_factory", "--mode", "local_sgd", "-O", "k_steps=2.7"]) == 2
    assert "option 'k_steps' of LocalSGD wants an int >= 1; got '2.7'" in capsys.readouterr().err


@pytest.mark.quick
@pytest.mark.parametrize("kwargs, message", [({"timeout": -1}, "positive"), ({"max_cached_programs": 0}, ">= 1")])
def test_step_keywords_are_checked(kwargs, message):
    model = MLP()
    with pytest.raises(ConfigurationError, match=message):
        transpile(model, _sgd(model), "fused_allreduce", loss_fn=LOSS, execution=Execution(**kwargs))


@pytest.mark.quick
def test_forgotten_init_process_group_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = MLP()
    with pytest.raises(ConfigurationError, match="init_process_group"):
        transpile(model, _sgd(model), loss_fn=LOSS)


@pytest.mark.quick
def test_bad_batches_on_later_calls_fail_before_the_graph_runs():
    model, opt, step, *_ = _pair(MLP)
    x, y = make_batch("mlp", 8, None)
    step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigurationError, match="batch element 0 is torch.float64.*traced for torch.float32"):
        step(x.double(), y)
    with pytest.raises(ConfigurationError, match="3 tensors.*traced for 2"):
        step(x, x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_retracing_is_bounded_and_warned():
    model, opt, step, twin, twin_opt = _pair(MLP, max_cached_programs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(3, 8):
            _steps(step, twin, twin_opt, n=1, seed=n, batch_size=n)
    assert step.traces == 5 and len(step._cache.entries) == 2
    assert [w for w in caught if issubclass(w.category, RetraceWarning) and "traced 4 times" in str(w.message)]
    assert_same_training_state(model, opt, twin, twin_opt)


def _trained(mode, make_opt=_sgd, model_cls=MLP, **options):
    torch.manual_seed(0)
    model = model_cls()
    step = transpile(model, make_opt(model), mode_config(mode, **options), loss_fn=LOSS)
    for _ in range(2):
        step(*make_batch("mlp", 8, None))
    return step


@pytest.mark.quick
@pytest.mark.parametrize(
    "saved, loading, message",
    [
        (("local_sgd", {"k_steps": 3}), ("local_sgd", {"k_steps": 5}), "schedule.*'k_steps': 3.*'k_steps': 5"),
        (("fused_allreduce", {}), ("local_sgd", {}), "mode"),
        (("fused_allreduce", {"bucket_cap_mb": 1}), ("fused_allreduce", {}), "bucket-cap-mb=1.0"),
    ],
)
def test_checkpoint_must_fit_the_step(saved, loading, message):
    ckpt = _trained(saved[0], **saved[1]).state_dict()
    with pytest.raises(CheckpointError, match=message):
        _trained(loading[0], **loading[1]).load_state_dict(ckpt)


def test_checkpoint_from_another_optimizer_or_model():
    ckpt = _trained("fused_allreduce", make_opt=lambda m: torch.optim.Adam(m.parameters())).state_dict()
    with pytest.raises(CheckpointError, match="optimizer: checkpoint 'Adam', this step 'SGD'"):
        _trained("fused_allreduce").load_state_dict(ckpt)
    with pytest.raises(CheckpointError, match="model entries missing.*body"):
        _trained("fused_allreduce", model_cls=DropoutBN).load_state_dict(_trained("fused_allreduce").state_dict())
    wide = _trained("fused_allreduce", model_cls=lambda: MLP(hidden=64)).state_dict()
    with pytest.raises(CheckpointError, match=r"shapes differ.*net\.0\.weight \[64, 20\] vs \[32, 20\]"):
        _trained("fused_allreduce").load_state_dict(wide)


def test_checkpoint_sets_only_declared_state():
    ckpt = _trained("local_sgd", k_steps=2).state_dict()
    bad = {**ckpt, "transpiler": {**ckpt["transpiler"], "schedule": {**ckpt["transpiler"]["schedule"], "k_steps": 9}}}
    with pytest.raises(CheckpointError, match="k_steps.*does not declare"):
        _trained("local_sgd", k_steps=2).load_state_dict(bad)
    bad = {**ckpt, "transpiler": {**ckpt["transpiler"], "extra": {"nonsense": torch.zeros(1)}}}
    with pytest.raises(CheckpointError, match="nonsense"):
        _trained("local_sgd", k_steps=2).load_state_dict(bad)


def test_checkpoint_world_size_must_match():
    ckpt = _trained("fused_allreduce").state_dict()
    model = MLP()
    inspect_only = transpile(model, _sgd(model), loss_fn=LOSS, mesh=StaticWorld(size=2, rank=0))
    with pytest.raises(CheckpointError, match="world size: checkpoint 1, this step 2"):
        inspect_only.load_state_dict(ckpt)
