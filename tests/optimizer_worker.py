"""One rank of the generic-optimizer runs at world size 2 (launched by tests/test_generic_optimizers_world.py).

For each optimizer, 4 steps from the same weights on this rank's shard, three ways against a reference
written here: ``fused_allreduce`` against DDP with the same optimizer; ``local_sgd`` (k_steps=2) against
eager local steps whose parameters are averaged (all-reduce, then /W) after each step the schedule
synchronised; ``adasum`` against the eager optimizer fed the published two-rank AdaSum of each tensor's
gradients, ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` in float64.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, Lion, make_batch, muon_and_adamw  # noqa: E402
from transpiler import TraceCache, mode_config, transpile  # noqa: E402

STEPS, PER_RANK = 4, 8
LOSS = nn.CrossEntropyLoss()
OPTIMIZERS = {
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.01),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, weight_decay=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=2),
    "Muon+AdamW": muon_and_adamw,
    "Lion": lambda p: Lion(p, lr=0.01, weight_decay=0.1),
}


def params_of(model: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def shards(rank: int, world: int) -> list:
    gen = torch.Generator().manual_seed(5)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return [tuple(t[sl] for t in make_batch("mlp", PER_RANK * world, gen)) for _ in range(STEPS)]


def base() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a64, b64 = a.double(), b.double()
    dot = (a64 * b64).sum()
    return ((1 - dot / (2 * (a64 * a64).sum())) * a64 + (1 - dot / (2 * (b64 * b64).sum())) * b64).to(a.dtype)


def run(name: str, rank: int, world: int) -> dict:
    make = OPTIMIZERS[name]
    data = shards(rank, world)
    out: dict = {}
    traces = TraceCache()  # the three modes share the optimizer's traces (before and after its state exists)
    for mode, options in (("fused_allreduce", {}), ("local_sgd", {"k_steps": 2}), ("adasum", {})):
        model = base()
        step = transpile(model, make(model.parameters()), mode_config(mode, **options), LOSS, trace=traces)
        out[mode] = {"ours": [], "variants": []}
        for x, y in data:
            step(x, y)
            out[mode]["ours"].append(params_of(model))
            out[mode]["variants"].append(step.last_variant)
    ddp = DDP(base())
    opt = make(ddp.parameters())
    local = base()
    local_opt = make(local.parameters())
    pair = base()
    pair_opt = make(pair.parameters())
    out["ddp"], out["local_ref"], out["adasum_ref"] = [], [], []
    for t, (x, y) in enumerate(data):
        opt.zero_grad()
        LOSS(ddp(x), y).backward()
        opt.step()
        out["ddp"].append(params_of(ddp.module))
        local_opt.zero_grad()
        LOSS(local(x), y).backward()
        local_opt.step()
        if out["local_sgd"]["variants"][t] == "sync":
            with torch.no_grad():
                for p in local.parameters():
                    dist.all_reduce(p)
                    p.div_(world)
        out["local_ref"].append(params_of(local))
        pair_opt.zero_grad()
        LOSS(pair(x), y).backward()
        for p in pair.parameters():
            both = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(both, p.grad)
            p.grad = adasum_pair(*both)
        pair_opt.step()
        out["adasum_ref"].append(params_of(pair))
    return out


def checks(rank: int, world: int) -> dict:
    return {name: run(name, rank, world) for name in OPTIMIZERS}


if __name__ == "__main__":
    run_rank(checks)
