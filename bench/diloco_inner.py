"""`diloco`'s inner step against the eager step torchft's DiLoCo runs between its syncs, one rank per core.

    python -m bench.diloco_inner          # W=2, about 1 minute; prints the table (docs/strategies/low_communication.md)

``bench/wan.py`` found our inner steps slower than torchft's (213 against 137 ms at 1 Gbit/s) with four ranks on
two cores. This sets the two steps side by side without that contention: two ranks, each pinned to a core of its
own with one thread, the ``bench/wan.py`` model (``bench/diloco.py``'s narrow GPT, 1.8M parameters) and batch.
torchft's DiLoCo wraps the user's eager loop and acts only in its optimizer's post-step hook at every H-th step,
so between syncs its step is the eager ``zero_grad``/forward/backward/``AdamW.step`` timed here. Ours is
``diloco`` (H = 15); only its ``inner`` program's steps are kept. Rounds alternate the two, ``H`` steps each,
after a barrier; the first round is warm-up. Each rank reports the medians; the table gives both ranks'.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from bench.diloco import LR, PER_RANK, corpus, model_for, windows
from bench.two_ranks import entry, finish_rank, two_rank_results
from transpiler import mode_config, transpile

H = 15  # DiLoCo's sync period: one round of each variant
ROUNDS = 16


def worker(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # a core of its own
    torch.set_num_threads(1)
    train, _, vocab = corpus()
    gen = torch.Generator().manual_seed(rank)
    batches = [windows(train, PER_RANK, gen) for _ in range(8)]
    ours_model, eager_model = model_for(vocab, 0), model_for(vocab, 0)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=LR, weight_decay=0.1)
    inner = torch.optim.AdamW(ours_model.parameters(), lr=LR, weight_decay=0.1)
    step = transpile(ours_model, inner, mode_config("diloco", sync_every=H), loss_fn=nn.CrossEntropyLoss())

    def eager(x: torch.Tensor, y: torch.Tensor) -> str:
        eager_opt.zero_grad()
        nn.functional.cross_entropy(eager_model(x), y).backward()
        eager_opt.step()
        return "inner"

    def ours(x: torch.Tensor, y: torch.Tensor) -> str:
        step(x, y)
        return step.last_variant

    variants = {"diloco": ours, "eager (torchft's inner step)": eager}
    times: dict[str, list[float]] = {key: [] for key in variants}
    taken = 0
    for round_ in range(ROUNDS):
        for key, run in variants.items():
            dist.barrier()
            for _ in range(H):
                x, y = batches[taken % len(batches)]
                taken += 1
                start = time.perf_counter()
                program = run(x, y)
                elapsed = (time.perf_counter() - start) * 1000
                if round_ and program == "inner":
                    times[key].append(elapsed)
    finish_rank(out, {key: {"ms": statistics.median(ms), "steps": len(ms)} for key, ms in times.items()})


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, _tmp: [out], port=29571)
    keys = list(ranks[0])
    print(f"inner step, median ms over {ROUNDS - 1} rounds of {H} steps (one rank per core, one thread each):\n")
    print("| rank | " + " | ".join(keys) + " | ratio |")
    print("|---:|" + "---:|" * (len(keys) + 1))
    for rank, result in enumerate(ranks):
        ms = [result[key]["ms"] for key in keys]
        print(f"| {rank} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ms[0] / ms[1]:.2f} |")


if __name__ == "__main__":
    entry(worker, main)
