"""One rank of the LocalSGD runs (launched by tests/test_local_sgd.py).

1. k_steps=1, plain SGD: local_sgd next to allreduce, same shards, 5 steps.
2. k_steps=3, begin_step=2, SGD with momentum, 12 steps: before every step an
   eager twin (the same local update) computes this rank's pre-sync
   parameters, which are all-gathered, so the test can check that a sync
   leaves every rank with their mean.
3. adaptive_local_sgd, 12 steps: the k after every sync and the avg_loss metric.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, make_batch  # noqa: E402
from transpiler import LocalSGD, mode_config, transpile  # noqa: E402

PER_RANK = 8


def params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def count_collectives(program) -> int:
    return sum(1 for n in program.graph.nodes if "collective" in n.meta)


def batches(world: int, steps: int, rank: int):
    gen = torch.Generator().manual_seed(5)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for _ in range(steps):
        x, y = make_batch("mlp", PER_RANK * world, gen)
        yield x[shard], y[shard]


def k1_against_allreduce(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = MLP()
    out = {}
    for mode, options in (("local_sgd", {"k_steps": 1}), ("allreduce", {})):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step = transpile(model, opt, mode_config(mode, **options), loss_fn=torch.nn.CrossEntropyLoss())
        out[mode] = []
        for x, y in batches(world, 5, rank):
            step(x, y)
            out[mode].append(params_of(model))
    return out


def sync_means(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = transpile(
        model,
        opt,
        LocalSGD(adaptive=False, k_steps=3, begin_step=2, bucket_cap_mb=0.004, first_bucket_mb=0.002),
        loss_fn=torch.nn.CrossEntropyLoss(),
    )
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    record = {"variants": [], "pre": [], "post": [], "collectives": 0, "per_variant": {}}
    for x, y in batches(world, 12, rank):
        twin.load_state_dict(model.state_dict())
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        twin_opt.zero_grad()  # eager, not the transpiler: this rank's parameters before the averaging
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        twin_opt.step()
        mine = params_of(twin)
        gathered = {n: [torch.empty_like(t) for _ in range(world)] for n, t in mine.items()}
        for n, t in mine.items():
            dist.all_gather(gathered[n], t)
        step(x, y)
        record["variants"].append(step.last_variant)
        record["pre"].append({n: torch.stack(ts) for n, ts in gathered.items()})
        record["post"].append(params_of(model))
        record["collectives"] += count_collectives(step.programs[step.last_variant])
    record["per_variant"] = {v: count_collectives(p) for v, p in step.programs.items()}
    record["snapshot_in_state_dict"] = sorted(step.state_dict()["transpiler"]["extra"])
    return record


def adaptive(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = transpile(model, opt, LocalSGD(adaptive=True, k_steps=2), loss_fn=torch.nn.CrossEntropyLoss())
    record = {"syncs": []}
    for t, (x, y) in enumerate(batches(world, 12, rank), start=1):
        loss = step(x, y)
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(()))
        if step.last_variant == "sync":
            record["syncs"].append((t, step.last_metrics["avg_loss"], [v.item() for v in losses], step.schedule.k))
    return record


def averaged_state(rank: int, world: int) -> list:
    """average_state=True: momentum buffers are averaged on sync steps too (k=2: syncs at 1, 3). Before each step
    a twin (eager SGD, the same local update) computes this rank's momentum before any averaging; every rank's
    is all-gathered, so the test can hold the step's momentum to their mean on sync steps and to this rank's own
    on local steps."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = transpile(
        model, opt, LocalSGD(adaptive=False, k_steps=2, average_state=True), loss_fn=torch.nn.CrossEntropyLoss()
    )
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    record = []
    for x, y in batches(world, 4, rank):
        twin.load_state_dict(model.state_dict())
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        twin_opt.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        twin_opt.step()
        pre = {}
        for n, p in twin.named_parameters():
            mine = twin_opt.state[p]["momentum_buffer"]
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            pre[n] = torch.stack(gathered)
        step(x, y)
        post = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
        record.append((step.last_variant, post, pre))
    return record


def checks(rank: int, world: int) -> dict:
    return {
        "k1": k1_against_allreduce(rank, world),
        "means": sync_means(rank, world),
        "adaptive": adaptive(rank, world),
        "averaged_state": averaged_state(rank, world),
    }


if __name__ == "__main__":
    run_rank(checks)
