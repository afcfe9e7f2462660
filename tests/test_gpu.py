"""The GPU lane: a world of one over NCCL on one CUDA device (skipped without CUDA, so CI stays green).

Run on a GPU machine with the project on the path: ``PYTHONPATH=$PWD python3 -m pytest -m gpu -s``.
Each check prints what it measured (``GPU <name>: ...``), so a run is also the record of the tolerances.
What one GPU cannot show (several ranks over NCCL) is argued in docs/gpu.md.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import free_port
from tests.models import make_batch, make_model
from transpiler import transpile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEVICE = torch.device("cuda", 0)
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
}


@pytest.fixture(scope="module", autouse=True)
def nccl_world_of_one():
    """Every collective of the programs really runs, through NCCL."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=120), device_id=DEVICE)
    yield
    dist.destroy_process_group()


def _eager_step(model, optimizer, loss_fn, batch, autocast: torch.dtype | None) -> torch.Tensor:
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()


def _train_both(model_name, opt_name, mode, autocast, steps=5, **options) -> tuple[float, float]:
    """Largest differences (parameters, loss) between the transpiled step and eager over ``steps`` steps."""
    torch.manual_seed(0)
    model = make_model(model_name).to(DEVICE)
    ref = copy.deepcopy(model)
    optimizer, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    loss_fn = nn.CrossEntropyLoss()
    step = transpile(model, optimizer, mode, loss_fn, **options)
    gen = torch.Generator().manual_seed(1)
    worst_param = worst_loss = 0.0
    for _ in range(steps):
        batch = tuple(t.to(DEVICE) for t in make_batch(model_name, 16, gen))
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = step(*batch)
        expected = _eager_step(ref, ref_opt, loss_fn, batch, autocast)
        worst_loss = max(worst_loss, (loss - expected).abs().item())
        worst_param = max(
            worst_param, *((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        )
    print(f"GPU {model_name} {opt_name} {mode} autocast={autocast}: param {worst_param:.3g}, loss {worst_loss:.3g}")
    return worst_param, worst_loss


@pytest.mark.parametrize("mode", ["none", "allreduce", "fused_allreduce", "local_sgd", "adasum"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fp32_every_single_rank_mode_follows_eager(mode, opt_name):
    """fp32 (no TF32), against eager's single-tensor path. Not bitwise on CUDA: the per-step scalars are 0-d
    tensors (so a compiled or captured program serves every step), and CUDA's ``add(alpha=)`` and
    ``addcdiv(value=)`` fuse the scalar into one rounding where ``addcmul`` by a tensor rounds the product
    first (on the CPU the same forms are bitwise, tests/test_tracing.py). One ulp of an update per step."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    param, loss = _train_both("mlp", opt_name, mode, None)
    assert param <= 1e-6 and loss <= 1e-6


def test_adamw_against_eager_foreach_within_rounding():
    """Eager takes the foreach path on CUDA by default, which rounds Adam's update in another order."""
    param, _ = _train_both("mlp", "adamw_foreach", "fused_allreduce", None)
    assert param <= 1e-5


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_bf16_autocast_around_the_step_follows_eager_autocast(model_name):
    param, loss = _train_both(model_name, "sgd", "fused_allreduce", torch.bfloat16)
    assert param <= 1e-3 and loss <= 1e-2


def test_compile_with_adamw_compiles_once_over_30_steps():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    param, _ = _train_both("mlp", "adamw", "fused_allreduce", None, steps=30, compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert param <= 1e-5
