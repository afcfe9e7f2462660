"""Autocast around the step: ``with torch.autocast(...): loss = step(x, y)``, as training loops are written.

The reference is eager autocast as torch documents it: the forward and the loss inside autocast, the backward
and ``optimizer.step()`` outside. On the CPU the transpiled step equals it bitwise: the trace records the
casts autocast makes, and the graph runs with autocast off, so nothing is cast twice.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bench.tiny_models import make_batch, make_model
from tests.helpers import assert_same_training_state, eager_step
from transpiler import DataParallel, LossScaling, transpile
from transpiler.runtime.plain_runner import plain_runner

pytestmark = pytest.mark.bitwise  # claims eager's bits: run again under narrower kernels in .ci/run

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
}


@pytest.mark.parametrize("mode", ["none", "fused_allreduce"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_bf16_autocast_around_the_step_is_bitwise_eager_autocast(mode, model_name, opt_name):
    torch.manual_seed(0)
    model = make_model(model_name)
    ref = copy.deepcopy(model)
    optimizer, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    loss_fn = nn.CrossEntropyLoss()
    step = transpile(model, optimizer, mode, loss_fn)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = make_batch(model_name, 8, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(*batch)
        expected = eager_step(ref, ref_opt, loss_fn, batch, ("cpu", torch.bfloat16))
        assert torch.equal(loss, expected)
        assert_same_training_state(model, optimizer, ref, ref_opt)
    assert any(n.target is torch.ops.aten._to_copy.default for n in step.program.graph.nodes)  # the casts
    runner = plain_runner(step.program.graph_module)  # what runs on a GPU: the copy into a bucket slot casts
    copies = [n for n in runner.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert all(n.args[1].target is not torch.ops.aten._to_copy.default for n in copies)


def test_switching_autocast_traces_each_state_once_and_follows_eager():
    """Autocast on, off, on again: two programs (the state is part of the cache key), each step as eager."""
    torch.manual_seed(0)
    model = make_model("mlp")
    ref = copy.deepcopy(model)
    optimizer, ref_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](ref.parameters())
    loss_fn = nn.CrossEntropyLoss()
    step = transpile(model, optimizer, "fused_allreduce", loss_fn)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, None, torch.bfloat16, None):
        batch = make_batch("mlp", 8, gen)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = step(*batch)
        assert torch.equal(loss, eager_step(ref, ref_opt, loss_fn, batch, ("cpu", dtype)))
        assert_same_training_state(model, optimizer, ref, ref_opt)
    assert step.traces == 2


def test_the_step_leaves_the_callers_autocast_as_it_was():
    model = make_model("mlp")
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "fused_allreduce", nn.CrossEntropyLoss())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(*make_batch("mlp", 8, torch.Generator().manual_seed(0)))
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


SCALED_OPTIMIZERS = {
    **OPTIMIZERS,
    # eager's first step takes the gradient as the buffer, later ones dampen it: a skipped first step must not
    # leave a buffer behind (it did: 0.017 off after 10 steps)
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),  # the generic path creates its state
}


@pytest.mark.parametrize("opt_name", sorted(SCALED_OPTIMIZERS))
def test_fp16_autocast_with_dynamic_loss_scaling_is_bitwise_grad_scaler(opt_name):
    """fp16 autocast around the step with ``loss_scale="dynamic"`` against eager's GradScaler with the same
    settings. The first scale (2**20) overflows fp16 in the backward, so the first steps are skipped and the
    scale backs off as GradScaler's does; later it grows every 3 clean steps. Powers of two scale exactly.
    A skipped step creates no optimizer state, as eager's ``step()`` never ran."""
    torch.manual_seed(0)
    model = make_model("mlp")
    ref = copy.deepcopy(model)
    make_opt = SCALED_OPTIMIZERS[opt_name]
    optimizer, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    loss_fn = nn.CrossEntropyLoss()
    settings = {"init_scale": 2.0**20, "growth_interval": 3}
    step = transpile(model, optimizer, DataParallel(loss_scaling=LossScaling(**settings)), loss_fn)
    scaler = torch.amp.GradScaler("cpu", **settings)  # measured: 5 of 16 steps skipped, the scale backs off and grows
    gen = torch.Generator().manual_seed(1)
    skipped, scales = 0, []
    for _ in range(16):
        batch = make_batch("mlp", 8, gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = step(*batch)
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            expected = loss_fn(ref(*batch[:-1]), batch[-1])
        scaler.scale(expected).backward()
        scaler.step(ref_opt)
        used = scaler.get_scale()  # the metric is the scale this step used, before the update
        scaler.update()
        assert torch.equal(loss, expected.detach())
        assert step.last_metrics["loss_scale"] == used
        scales.append(used)
        skipped += int(step.last_metrics["overflow"])
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        if ref_opt.state:
            assert_same_training_state(model, optimizer, ref, ref_opt)
        else:  # only skipped steps so far: the twins' Adam state exists from the start (zeros), nothing else does
            held = [t for p in model.parameters() for t in optimizer.state.get(p, {}).values()]
            assert all(not t.any() for t in held) and (opt_name in ("adamw",) or not held)
    assert 1 <= skipped < 16 and ref_opt.state
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))  # it grew again too
