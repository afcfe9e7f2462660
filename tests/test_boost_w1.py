"""The Boost and SINGA strategies at world size 1, against eager PyTorch written out in the test.

At world size 1 every reduction is the identity, so each strategy must be
exactly the eager recipe it stands for: bitwise where the ops are the same.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from bench.tiny_models import MLP, make_batch
from tests.helpers import assert_same_training_state
from transpiler import (
    Accumulation,
    Clipping,
    Compression,
    ConfigurationError,
    DataParallel,
    Freeze,
    LossScaling,
    Sparsification,
    mode_config,
    transpile,
)
from transpiler.strategies.schedules import continuous_freeze_cycle

pytestmark = pytest.mark.bitwise  # claims eager's or DDP's bits: run again under narrower kernels in .ci/run

LOSS = nn.CrossEntropyLoss()


def setup(opt="sgd", seed=0):
    torch.manual_seed(seed)
    model = MLP()
    make = {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    }[opt]
    twin = copy.deepcopy(model)
    return model, make(model), twin, make(twin)


def data(n_batches, size=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [make_batch("mlp", size, gen) for _ in range(n_batches)]


def test_accumulation_equals_eager_micro_batches_and_resumes_mid_cycle():
    """Bitwise: eager ``(loss / k).backward()`` per micro-batch, one ``step()`` per k, is the same arithmetic."""
    model, opt, twin, twin_opt = setup()
    step = transpile(model, opt, DataParallel(accumulation=Accumulation(steps=2)), LOSS)
    batches = data(6)
    variants = []
    for i, (x, y) in enumerate(batches):
        step(x, y)
        variants.append(step.last_variant)
        (LOSS(twin(x), y) / 2).backward()
        if i % 2 == 1:
            twin_opt.step()
            twin_opt.zero_grad()
        if i == 2:  # mid-cycle: one micro-batch accumulated
            saved = step.state_dict()
            assert any(k.startswith("accum.") for k in saved["transpiler"]["extra"])
            assert saved["transpiler"]["schedule"]["micro_step"] == 1
    assert variants == ["accumulate", "step"] * 3
    assert not any("collective" in n.meta for n in step.programs["accumulate"].graph.nodes)
    assert_same_training_state(model, opt, twin, twin_opt)
    after = copy.deepcopy(step.state_dict())
    step.load_state_dict(saved)  # resume from the middle of a cycle: the rest replays bitwise
    for x, y in batches[3:]:
        step(x, y)
    for name, value in after["model"].items():
        assert torch.equal(model.state_dict()[name], value), name


def test_accumulation_is_one_step_on_the_concatenated_batch():
    """Within float rounding: the mean of micro-batch means is the mean over their concatenation."""
    model, opt, twin, twin_opt = setup()
    step = transpile(model, opt, DataParallel(accumulation=Accumulation(steps=4)), LOSS)
    batches = data(4)
    for x, y in batches:
        step(x, y)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    LOSS(twin(x), y).backward()
    twin_opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_loss_scaling_without_overflow_is_bitwise_the_unscaled_run(opt):
    """A power-of-two scale multiplies every backward value exactly; the unscale undoes it exactly."""
    model, o, twin, twin_o = setup(opt)
    scaled = transpile(model, o, DataParallel(loss_scaling=LossScaling(growth_interval=2)), LOSS)
    plain = transpile(twin, twin_o, "fused_allreduce", LOSS)
    scales = []
    for x, y in data(5):
        scaled(x, y)
        plain(x, y)
        scales.append(scaled.last_metrics["loss_scale"])
        assert scaled.last_metrics["overflow"] == 0.0
    assert scales == [2.0**16, 2.0**16, 2.0**17, 2.0**17, 2.0**18]  # doubles after exactly 2 clean steps
    assert_same_training_state(model, o, twin, twin_o)
    assert scaled.state_dict()["transpiler"]["extra"]["loss_scale.scale"] == 2.0**18


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_overflow_skips_the_update_and_backs_off(opt):
    model, o, _, _ = setup(opt)
    step = transpile(model, o, DataParallel(loss_scaling=LossScaling(init_scale=8.0, min_scale=2.0)), LOSS)
    (x, y), _ = data(2)
    step(x, y)
    before = copy.deepcopy((model.state_dict(), o.state_dict()))
    bad = x.clone()
    bad[0, 0] = float("inf")
    step(bad, y)
    assert step.last_metrics == {"overflow": 1.0, "loss_scale": 8.0}
    after = (model.state_dict(), o.state_dict())
    for name, value in before[0].items():
        assert torch.equal(after[0][name], value), name
    for key, state in before[1]["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(after[1]["state"][key][k]), torch.as_tensor(v)), (key, k)
    step(bad, y)
    step(bad, y)  # backs off to the floor, not below
    assert float(step.extra["loss_scale.scale"]) == 2.0


def test_fixed_loss_scale_never_changes():
    model, o, _, _ = setup()
    step = transpile(model, o, DataParallel(loss_scaling=LossScaling(dynamic=False, init_scale=128.0)), LOSS)
    (x, y), _ = data(2)
    bad = x.clone()
    bad[0, 0] = float("nan")
    step(bad, y)
    assert step.last_metrics == {"overflow": 1.0, "loss_scale": 128.0}
    assert "loss_scale.growth_tracker" not in step.extra


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_equals_clip_grad_norm_(norm_type):
    model, o, twin, twin_o = setup()
    step = transpile(model, o, DataParallel(clipping=Clipping(max_norm=0.3, norm_type=norm_type)), LOSS)
    for x, y in data(4):
        step(x, y)
        twin_o.zero_grad()
        LOSS(twin(x), y).backward()
        total = nn.utils.clip_grad_norm_(twin.parameters(), 0.3, norm_type=norm_type)
        twin_o.step()
        assert step.last_metrics["grad_norm"] == float(total)
    assert_same_training_state(model, o, twin, twin_o)


def test_clipping_with_accumulation_and_loss_scaling_clips_the_accumulated_unscaled_gradient():
    model, o, twin, twin_o = setup()
    step = transpile(
        model,
        o,
        DataParallel(accumulation=Accumulation(steps=2), loss_scaling=LossScaling(), clipping=Clipping(max_norm=0.2)),
        LOSS,
    )
    for i, (x, y) in enumerate(data(4)):
        step(x, y)
        (LOSS(twin(x), y) / 2).backward()
        if i % 2:
            total = nn.utils.clip_grad_norm_(twin.parameters(), 0.2)
            twin_o.step()
            twin_o.zero_grad()
            assert step.last_metrics["grad_norm"] == float(total)
    assert_same_training_state(model, o, twin, twin_o)


def test_freeze_schedule_and_frozen_groups_unchanged():
    model, o, _, _ = setup()
    step = transpile(model, o, DataParallel(freeze=Freeze(groups=3, type=0, p=0.5)), LOSS)
    cycle = continuous_freeze_cycle(3, 0.5)
    assert cycle == [0, 0, 1, 2]
    # 6 parameter tensors: groups of 2
    seen = []
    for t, (x, y) in enumerate(data(8)):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        momenta = {n: o.state[p].get("momentum_buffer") for n, p in model.named_parameters()}
        momenta = {n: None if m is None else m.clone() for n, m in momenta.items()}
        step(x, y)
        index = int(step.last_variant.rpartition("freeze")[2])
        seen.append(index)
        for i, (n, p) in enumerate(model.named_parameters()):
            frozen = i < 2 * index
            assert torch.equal(p, params[n]) == frozen, (t, n)
            if frozen and momenta[n] is not None:
                assert torch.equal(o.state[p]["momentum_buffer"], momenta[n])
    assert seen == cycle * 2
    mm = torch.ops.aten.mm.default
    ops = {v: len(p.graph.find_nodes(op="call_function", target=mm)) for v, p in step.programs.items()}
    assert ops["step/freeze2"] < ops["step/freeze1"] < ops["step/freeze0"]  # the backward is truncated


@pytest.mark.parametrize(
    "mode,options",
    [
        ("fused_allreduce", {"sparsification": Sparsification(ratio=1.0)}),
        ("fused_allreduce", {"bucket_cap_mb": 0.0}),
        ("allgather", {}),
        ("partial_sync", {"partitions": 3}),
    ],
)
def test_world_size_one_is_the_eager_step(mode, options):
    model, o, twin, twin_o = setup()
    step = transpile(model, o, mode_config(mode, **options), LOSS)
    for x, y in data(4):
        step(x, y)
        twin_o.zero_grad()
        LOSS(twin(x), y).backward()
        twin_o.step()
    assert_same_training_state(model, o, twin, twin_o)


@pytest.mark.parametrize(
    "mode,options,message",
    [
        ("adasum", {"compression": Compression()}, "'compression' works with fused_allreduce, local_sgd"),
        ("local_sgd", {"clipping": Clipping(max_norm=1.0)}, "'clipping' works with allreduce, fused_allreduce"),
        ("fused_allreduce", {"sparsification.threshold": 0.1}, "Sparsification: .* required .*'ratio'"),
        ("fused_allreduce", {"sparsification.ratio": 0.1, "loss_scaling.dynamic": True}, "do not compose"),
        ("fused_allreduce", {"sparsification.ratio": 0.1, "compression.wire_dtype": "fp16"}, "do not compose"),
        ("fused_allreduce", {"loss_scaling.init_scale": "sometimes"}, "'init_scale' of LossScaling wants a finite"),
        ("fused_allreduce", {"compression.wire_dtype": "int8"}, "one of fp16, bf16"),
        ("fused_allreduce", {"freeze.groups": 2, "freeze.p": 1.0}, "<= 0.99"),
    ],
)
def test_unsupported_combinations_are_configuration_errors(mode, options, message):
    model, o, _, _ = setup()
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        transpile(model, o, mode_config(mode, **options), LOSS)


def test_freeze_refuses_adam_and_too_many_groups():
    model, o, _, _ = setup("adam")
    with pytest.raises(ConfigurationError, match="works with torch.optim.SGD"):
        transpile(model, o, DataParallel(freeze=Freeze(groups=2)), LOSS)
    model, o, _, _ = setup()
    x, y = data(1)[0]
    with pytest.raises(ConfigurationError, match="6 trainable parameters"):
        transpile(model, o, DataParallel(freeze=Freeze(groups=7)), LOSS, (x, y))
