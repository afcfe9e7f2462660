"""Ops a step dispatches, and its time, on narrow models where the host's dispatching is the step's cost.

    python -m bench.host_ops        # one torchrun world of 2 over gloo, about 3 minutes; writes docs/performance.md

Two narrow models (``bench/models.py``: a 12-block GPT of width 16 and a 16-block ResNet-style CNN with
BatchNorm and 8 channels) train with AdamW in every variant: DDP with ``foreach=True`` (the multi-tensor update
torch picks on CUDA) and with the for-loop (``foreach=False``, what it picks on the CPU), and the transpiled
``fused_allreduce``, ``zero1``, ``zero2``, ``zero3``, and ``fused_allreduce`` with ``compile=True``. Each rank
builds every variant from the same weights, counts the aten ops of one step after warm-up
(``bench/op_count.py``: work ops, about one kernel launch each on a GPU, and view ops), then times the variants
interleaved, round by round. The table gives rank 0's counts (every rank dispatches the same) and, per variant,
the median step time of the slower rank, with its ratio to DDP with foreach AdamW in the same run. Compiled
programs cannot be counted (Dynamo refuses a dispatch mode around them). Nothing here is a test.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.models import NARROW, narrow_batch
from bench.op_count import count_ops
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import Execution, transpile

ROOT = Path(__file__).resolve().parent.parent

PER_RANK = {"gpt": 4, "cnn": 8}
TITLE = {"gpt": "12-block GPT, d=16", "cnn": "16-block ResNet-style CNN with BatchNorm, 8 channels"}
WARMUP, STEPS, ROUNDS = 3, 10, 7
REFERENCE = "DDP, AdamW foreach"
# label -> (mode or "ddp", the step's execution settings or DDP's AdamW options)
VARIANTS: dict[str, tuple[str, dict]] = {
    REFERENCE: ("ddp", {"foreach": True}),
    "DDP, AdamW for-loop": ("ddp", {"foreach": False}),
    "fused_allreduce": ("fused_allreduce", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "fused_allreduce, compile=True": ("fused_allreduce", {"compile": True}),
}
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- host_ops -->", "<!-- /host_ops -->"


def build_variants(name: str, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """One step function per variant, each on its own copy of the same weights."""
    torch.manual_seed(0)
    base = NARROW[name]()
    loss_fn = torch.nn.CrossEntropyLoss()
    runs: dict[str, Callable[[], object]] = {}
    for label, (mode, options) in VARIANTS.items():
        model = copy.deepcopy(base)
        if mode == "ddp":
            ddp = DDP(model, gradient_as_bucket_view=True)
            optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, **options)

            def step(ddp=ddp, optimizer=optimizer) -> None:
                optimizer.zero_grad()
                loss_fn(ddp(batch[0]), batch[1]).backward()
                optimizer.step()

            runs[label] = step
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            transpiled = transpile(model, optimizer, mode, loss_fn, batch, execution=Execution(**options))
            runs[label] = lambda transpiled=transpiled: transpiled(*batch)
    return runs


def interleaved_ms(runs: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """ms per step of each variant, one figure per round; each round takes the variants in turn, each with
    ``WARMUP`` untimed steps, a barrier, and ``STEPS`` timed ones."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(ROUNDS):
        for label, run in runs.items():
            for _ in range(WARMUP):
                run()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                run()
            times[label].append((time.perf_counter() - start) / STEPS * 1000)
    return times


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result: dict[str, dict] = {}
    for name in NARROW:
        batch = narrow_batch(name, PER_RANK[name], torch.Generator().manual_seed(rank))
        runs = build_variants(name, batch)
        counts = {}
        for label, run in runs.items():
            for _ in range(WARMUP):
                run()
            if not VARIANTS[label][1].get("compile"):
                counter = count_ops(run)
                counts[label] = {"work": counter.work, "views": counter.views}
        times = interleaved_ms(runs)
        result[name] = {"counts": counts, "ms": {label: statistics.median(t) for label, t in times.items()}}
    finish_rank(out, result)


def table(ranks: list[dict]) -> str:
    lines = []
    for name in NARROW:
        counts = ranks[0][name]["counts"]
        ms = {label: max(r[name]["ms"][label] for r in ranks) for label in VARIANTS}
        ref = counts[REFERENCE]
        lines += [
            f"**{TITLE[name]}** (`bench/models.py:{NARROW[name].__name__}`), {PER_RANK[name]} samples per rank:",
            "",
            "| variant | work ops | × DDP-foreach | view ops | × DDP-foreach | step ms | × DDP-foreach |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for label in VARIANTS:
            c = counts.get(label)
            ops = (
                f"{c['work']} | {c['work'] / ref['work']:.2f} | {c['views']} | {c['views'] / ref['views']:.2f}"
                if c
                else "– | – | – | –"
            )
            lines.append(f"| {label} | {ops} | {ms[label]:.2f} | {ms[label] / ms[REFERENCE]:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, _: [out], port=29587)
    cpu = platform.processor() or platform.machine()
    body = (
        f"`python -m bench.host_ops` (W=2 over gloo, one thread per rank, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, {cpu}; step ms: median over {ROUNDS} rounds of {STEPS} steps, the slower rank):\n\n"
        + table(ranks)
    )
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    entry(rank_main, main)
