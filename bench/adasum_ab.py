"""AdaSum against DDP, interleaved, without other variants in the run (bench/limit.py mixes in compiled ones).

torchrun --nproc-per-node 2 bench/adasum_ab.py      # prints one line per workload (rank 0)
"""

from __future__ import annotations

import statistics
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.limit import WORKLOADS, Step, interleaved


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for name, (build, make_batch) in WORKLOADS.items():
        torch.manual_seed(0)
        base = build()
        batch = make_batch(torch.Generator().manual_seed(rank))
        steps = {label: Step(label, base, batch) for label in ("ddp", "adasum")}
        times = interleaved(steps)
        if rank == 0:
            ddp, ours = (statistics.median(times[k]) * 1e3 for k in ("ddp", "adasum"))
            print(f"| {name} | {ddp:.1f} | {ours:.1f} | {ours / ddp:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
