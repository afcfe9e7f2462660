"""One rank of the step-time benchmark: DDP vs the transpiled modes, same run.

Launched by bench/run.py (or: torchrun --nproc-per-node 2 bench/step_time.py OUT.json).
Variants are interleaved round by round, so drift on the machine hits them
all alike; each round times STEPS steps after WARMUP; the median over rounds
is reported.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.models import batch_for, build  # noqa: E402
from transpiler import transpile  # noqa: E402

PER_RANK = {"mlp_5m": 64, "transformer": 32}
WARMUP, STEPS, ROUNDS = 3, 10, 15
VARIANTS = ("ddp", "allreduce", "fused_allreduce")


def make_runner(variant: str, base: torch.nn.Module, batch):
    model = copy.deepcopy(base)
    loss_fn = torch.nn.CrossEntropyLoss()
    if variant == "ddp":
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

        def run(x, y):
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()

        run(*batch)  # buckets are rebuilt after the first iteration
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        return run, len([s for s in str(sizes).split(",") if s])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = transpile(model, opt, mode=variant, loss_fn=loss_fn, example_inputs=batch)
    collectives = sum(1 for n in step.graph_module.graph.nodes if "collective" in n.meta)
    return step, collectives


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {}
    for name in ("mlp_5m", "transformer"):
        torch.manual_seed(0)
        base = build(name)
        params = sum(p.numel() for p in base.parameters())
        gen = torch.Generator().manual_seed(rank)
        batch = batch_for(name, PER_RANK[name], gen)
        runners = {v: make_runner(v, base, batch) for v in VARIANTS}
        times = {v: [] for v in VARIANTS}
        for _ in range(ROUNDS):
            for variant, (run, _) in runners.items():
                for _ in range(WARMUP):
                    run(*batch)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(STEPS):
                    run(*batch)
                dist.barrier()
                times[variant].append((time.perf_counter() - start) / STEPS)
        results[name] = {
            "params": params,
            "grad_bytes": params * 4,
            "per_rank_batch": PER_RANK[name],
            "variants": {
                v: {"median_s": statistics.median(times[v]), "rounds_s": times[v], "collectives": runners[v][1]}
                for v in VARIANTS
            },
        }
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
