"""Where a mode's step time goes on the CPU: torch.profiler's self time per op on rank 0, modes side by side.

    python -m bench.profile_modes zero1 zero2      # launches torchrun at W=2 over gloo, prints one table per mode

Each rank builds every mode from the same weights (AdamW; plain SGD for ``demo``, which steps with it; the
5M-parameter MLP of bench/models.py), warms it
up for 3 steps, and profiles 5 more. ``wait_tensor`` is the time a rank blocks on its collectives (what the
schedule did not overlap, and any skew between the ranks); the aten ops are the compute. The minor page faults
per step count the memory the allocator took back from the kernel: with ``Execution(keep_freed_memory=False)`` glibc
returns large freed blocks, so a buffer allocated each step faults its pages in again; the default keeps them
(bench/host_memory.py compares the two). Nothing here is a test.
"""

from __future__ import annotations

import copy
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench.models import start_rank
from bench.two_ranks import run_two_ranks
from transpiler import transpile

ROOT = Path(__file__).resolve().parent.parent

MODEL, PER_RANK, WARMUP, STEPS = "mlp_5m", 32, 3, 5


def rank_main(modes: list[str]) -> None:
    rank, base, batch = start_rank(MODEL, PER_RANK)
    for mode in modes:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD if mode == "demo" else torch.optim.AdamW
        step = transpile(model, optimizer(model.parameters(), lr=1e-4), mode, torch.nn.CrossEntropyLoss())
        for _ in range(WARMUP):
            step(*batch)
        dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS):
                step(*batch)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / STEPS
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=45)
            print(f"{mode}: {STEPS} steps on rank 0, {faults:.0f} minor page faults per step\n{table}", flush=True)
    # no destroy_process_group(): torch 2.13 can deadlock there (bench/memory.py); the tables are printed
    os._exit(0)


def main() -> None:
    modes = sys.argv[1:] or ["zero1", "zero2"]
    run_two_ranks(__file__, modes, port=29583, timeout=900)


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(sys.argv[1:])
    else:
        main()
