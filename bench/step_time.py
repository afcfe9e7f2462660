"""One rank of the step-time benchmark: DDP vs the transpiled modes, same run.

Launched by bench/run.py (or: torchrun --nproc-per-node 2 bench/step_time.py OUT.json).
Variants are interleaved round by round, so drift on the machine hits them
all alike; each round times STEPS steps after WARMUP; the median over rounds
is reported.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.models import batch_for, build
from transpiler import Accumulation, Clipping, Compression, Freeze, LossScaling, Sparsification, mode_config, transpile

PER_RANK = {"mlp_5m": 64, "transformer": 32}
WARMUP, STEPS, ROUNDS = 4, 12, 8
VARIANTS = {  # label: (mode, options); "ddp" options: accumulate (no_sync calls per update), hook (fp16, bf16)
    "ddp": ("ddp", {}),
    "allreduce": ("allreduce", {}),
    "fused_allreduce": ("fused_allreduce", {}),
    "local_sgd k=1": ("local_sgd", {"k_steps": 1}),
    "local_sgd k=4": ("local_sgd", {"k_steps": 4}),
    "local_sgd k=16": ("local_sgd", {"k_steps": 16}),
    "adaptive_local_sgd": ("adaptive_local_sgd", {"k_steps": 2}),
    "adasum": ("adasum", {}),
    "adasum_delta": ("adasum_delta", {}),
    "ddp no_sync k=4": ("ddp", {"accumulate": 4}),
    "fused accumulate_steps=4": ("fused_allreduce", {"accumulation": Accumulation(steps=4)}),
    "fused loss_scale=dynamic": ("fused_allreduce", {"loss_scaling": LossScaling()}),
    "fused max_grad_norm=1": ("fused_allreduce", {"clipping": Clipping(max_norm=1.0)}),
    "ddp fp16 hook": ("ddp", {"hook": "fp16"}),
    "fused compress=fp16": ("fused_allreduce", {"compression": Compression(wire_dtype="fp16")}),
    "fused compress=bf16": ("fused_allreduce", {"compression": Compression(wire_dtype="bf16")}),
    "fused sparsify=0.01": ("fused_allreduce", {"sparsification": Sparsification(ratio=0.01)}),
    "fused sparsify=0.1": ("fused_allreduce", {"sparsification": Sparsification(ratio=0.1)}),
    "fused freeze_groups=4": ("fused_allreduce", {"freeze": Freeze(groups=4, type=0, p=0.5)}),
    "partial_sync partitions=4": ("partial_sync", {"partitions": 4}),
    "allgather": ("allgather", {}),
}
HOOKS = {"fp16": default_hooks.fp16_compress_hook}  # DDP's bf16 hook needs NCCL or XCCL: none on gloo/CPU


def payload(program) -> tuple[int, int]:
    """Communication operations in a program, and the bytes this rank hands to them."""
    ops, sent = 0, 0
    for node in program.graph.nodes:
        if "collective" in node.meta:
            ops += 1
            sent += node.meta["collective"].get("bytes", 0)
        elif "p2p" in node.meta:
            ops += 1
            val = node.args[0].meta["val"]
            sent += val.numel() * val.element_size()
    return ops, sent


class Runner:
    """One variant: a step function, and what it communicated over the steps it ran."""

    def __init__(self, label: str, base: torch.nn.Module, batch):
        mode, options = VARIANTS[label]
        model = copy.deepcopy(base)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.ops = self.bytes = self.steps = 0
        if mode == "ddp":
            self.ddp = DDP(model)
            if "hook" in options:
                self.ddp.register_comm_hook(None, HOOKS[options["hook"]])
            self.accumulate, self.calls = options.get("accumulate", 1), 0
            self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01, momentum=0.9)
            self.step, self.per_step = None, (0, 0)
            for _ in range(self.accumulate):
                self(*batch)  # buckets are rebuilt after the first iteration
            sizes = [int(s) for s in str(self.ddp._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if s]
            wire = 2 if "hook" in options else 4
            self.per_step = (len(sizes), sum(p.numel() * wire for p in model.parameters()))
            return
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.step = transpile(model, opt, mode_config(mode, **options), loss_fn=self.loss_fn, example_inputs=batch)
        self.payloads = {v: payload(p) for v, p in self.step.programs.items()}

    def __call__(self, x, y) -> None:
        if self.step is None:
            self.calls += 1
            update = self.calls % self.accumulate == 0
            with contextlib.nullcontext() if update else self.ddp.no_sync():
                (self.loss_fn(self.ddp(x), y) / self.accumulate).backward()
            if update:
                self.opt.step()
                self.opt.zero_grad()
            ops, sent = self.per_step if update else (0, 0)
        else:
            self.step(x, y)
            ops, sent = self.payloads[self.step.last_variant]
        self.ops, self.bytes, self.steps = self.ops + ops, self.bytes + sent, self.steps + 1


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
        runners = {v: Runner(v, base, batch) for v in VARIANTS}
        for run in runners.values():
            run.ops = run.bytes = run.steps = 0
        times = {v: [] for v in VARIANTS}
        for _ in range(ROUNDS):
            for variant, run in runners.items():
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
                v: {
                    "median_s": statistics.median(times[v]),
                    "rounds_s": times[v],
                    "ops_per_step": runners[v].ops / runners[v].steps,
                    "bytes_per_step": runners[v].bytes / runners[v].steps,
                }
                for v in VARIANTS
            },
        }
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
