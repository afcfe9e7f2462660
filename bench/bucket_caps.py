"""Does a smaller bucket cap buy overlap on this machine? fused_allreduce at several caps against DDP.

    torchrun --nproc-per-node 2 bench/bucket_caps.py      # prints one line per workload (rank 0)

Same steps and interleaving as bench/limit.py, on the MLP (batch 64) and the 8-block transformer.
"""

from __future__ import annotations

import statistics
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.limit import FUSED, WORKLOADS, Step, interleaved

CAPS = (25, 8, 4, 2, 1)
SWEPT = ("MLP 1024-2048-1024-10, batch 64", "transformer 8 blocks d=128, 16x32 tokens")


def main() -> None:
    FUSED.update({f"cap {c} MiB": {"bucket_cap_mb": float(c), "first_bucket_mb": min(1.0, float(c))} for c in CAPS})
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for name in SWEPT:
        build, make_batch = WORKLOADS[name]
        torch.manual_seed(0)
        base = build()
        batch = make_batch(torch.Generator().manual_seed(rank))
        labels = ["ddp", *(f"cap {c} MiB" for c in CAPS)]
        steps = {label: Step(label, base, batch) for label in labels}
        times = interleaved(steps)
        if rank == 0:
            print(name, {label: round(statistics.median(t) * 1e3, 1) for label, t in times.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
