"""One rank of the multi-process parity runs (launched by bench/harness/launch.py).

For each scenario (model, optimizer, mode) it trains STEPS steps three ways
from the same initial weights and the same global batches: the transpiled step
on this rank's shard, PyTorch DDP on the same shard, and (rank 0 only) a
single-process reference. Rank 0 saves every step's parameters, buffers and
optimizer state; every rank saves its transpiled parameters, so the test can
check that all ranks agree.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import make_batch, make_model, make_optimizer  # noqa: E402
from transpiler import TraceCache, mode_config, transpile  # noqa: E402

STEPS = 5
PER_RANK = 8


def snapshot(model, optimizer) -> dict:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    state = {
        f"{n}.{k}": v.detach().clone()
        for n, p in model.named_parameters()
        for k, v in optimizer.state.get(p, {}).items()
        if torch.is_tensor(v)
    }
    return {"params": params, "buffers": buffers, "state": state}


def reference_step(model, optimizer, loss_fn, x, y, world: int, per_shard: bool) -> None:
    """Single process: full batch, or (BatchNorm) shard by shard with grads summed as 1/W shares."""
    optimizer.zero_grad()
    if per_shard:
        for r in range(world):
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            (loss_fn(model(x[sl]), y[sl]) / world).backward()
    else:
        loss_fn(model(x), y).backward()
    optimizer.step()


def run_scenario(model_name: str, opt_name: str, mode: str, rank: int, world: int, traces: TraceCache) -> dict:
    torch.manual_seed(1234)
    base = make_model(model_name)
    loss_fn = torch.nn.CrossEntropyLoss()
    ours = copy.deepcopy(base)
    ddp_model = copy.deepcopy(base)
    ours_opt = make_optimizer(opt_name, ours.parameters())
    ddp = DDP(ddp_model)
    ddp_opt = make_optimizer(opt_name, ddp.parameters())
    single = copy.deepcopy(base)
    single_opt = make_optimizer(opt_name, single.parameters())
    gen = torch.Generator().manual_seed(99)
    batches = [make_batch(model_name, PER_RANK * world, gen) for _ in range(STEPS)]
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    options = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.001} if mode == "fused_allreduce" else {}
    if mode == "fused_auto":  # caps chosen on the cost model the ranks measure at startup
        mode, options = "fused_allreduce", {"bucket_cap_mb": "auto"}
    if mode == "fused_flat":  # buckets concatenated each step, as before persistent buffers
        mode, options = "fused_allreduce", {**options, "bucket_cap_mb": 0.002, "gradient_as_bucket_view": False}
    step = transpile(
        ours,
        ours_opt,
        mode_config(mode, **options),
        loss_fn=loss_fn,
        example_inputs=(batches[0][0][shard], batches[0][1][shard]),
        trace=traces,
    )
    record = {"ours": [], "ddp": [], "single": [], "losses": []}
    for x, y in batches:
        loss = step(x[shard], y[shard])
        ddp_opt.zero_grad()
        ddp_loss = loss_fn(ddp(x[shard]), y[shard])
        ddp_loss.backward()
        ddp_opt.step()
        record["ours"].append(snapshot(ours, ours_opt))
        record["losses"].append((loss.item(), ddp_loss.item()))
        if rank == 0:
            record["ddp"].append(snapshot(ddp.module, ddp_opt))
            reference_step(single, single_opt, loss_fn, x, y, world, per_shard=model_name == "cnn")
            record["single"].append(snapshot(single, single_opt))
    record["collectives"] = sum(1 for n in step.graph_module.graph.nodes if "collective" in n.meta)
    record["decisions"] = dict(step.program.decisions)
    return record


def checks(rank: int, world: int, scenarios: str) -> dict:
    results = {}
    traces = TraceCache()  # scenarios of one model and optimizer under several modes share their traces
    for scenario in scenarios.split(";"):
        model_name, opt_name, mode = scenario.split(",")
        results[scenario] = run_scenario(model_name, opt_name, mode, rank, world, traces)
    return results


if __name__ == "__main__":
    run_rank(checks)
