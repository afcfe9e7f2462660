"""What a step costs before it trains: the first call of a transpiled step (trace, passes, the startup handshake,
rank 0's broadcast, one step) against a later step, per mode, on the narrow GPT in a live world.

Every rank pays this at startup and again after each elastic restart. ``python -m bench.build_time --world 4``
runs it under torchrun (gloo, one thread per rank) and prints, per mode, the slowest rank's first call and its
median later step, in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from bench.models import NarrowGPT, narrow_batch
from bench.two_ranks import entry, finish_rank, two_rank_results
from transpiler import transpile

MODES = ("fused_allreduce", "zero2", "zero3", "diloco")
LATER = 5  # later steps timed per mode


def measure(mode: str, rank: int) -> dict[str, float]:
    """The first call of a fresh step and the median of the next :data:`LATER`, on this rank."""
    torch.manual_seed(0)
    model = NarrowGPT()
    step = transpile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mode, loss_fn=nn.CrossEntropyLoss())
    batch = narrow_batch("gpt", 4, torch.Generator().manual_seed(rank))
    dist.barrier()
    start = time.perf_counter()
    step(*batch)
    first = time.perf_counter() - start
    later = []
    for _ in range(LATER):
        start = time.perf_counter()
        step(*batch)
        later.append(time.perf_counter() - start)
    return {"first_s": first, "step_s": statistics.median(later)}


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    finish_rank(out, {mode: measure(mode, rank) for mode in MODES})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    ranks = two_rank_results(__file__, lambda out, _: [out], port=29581, world=args.world)
    print(f"W={args.world}, narrow GPT, AdamW: the slowest rank, seconds")
    print(f"{'mode':<16}{'first call':>12}{'later step':>12}")
    for mode in MODES:
        first, later = (max(r[mode][key] for r in ranks) for key in ("first_s", "step_s"))
        print(f"{mode:<16}{first:>12.2f}{later:>12.3f}")


if __name__ == "__main__":
    entry(rank_main, main)
