"""A pipeline's split without split points (balanced by estimated time) against equal block counts, on the CPU.

    python -m bench.pipeline_split

Model: ``bench/models.py``'s ``UnevenMLP`` (four residual blocks of width 16, the first two of inner width 8192,
the others 16), batch 256 in 4 microbatches, 1F1B, SGD; two stages, one process and one thread each. Equal block
counts put both wide blocks in the first stage (split at ``blocks.2``); the balanced cut (``passes/stage_balance.py``)
splits at ``blocks.1``. Per row: the split, the cut's estimated ms per step by stage, and the median step time over
interleaved rounds (``bench/host_ops.py``; the slowest rank's).
"""

from __future__ import annotations

import os
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.cpu_kernels import cpu_model
from bench.host_ops import interleaved_ms
from bench.models import UnevenMLP
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import PipelineParallel, transpile

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m bench.pipeline_split"
DOC = ROOT / "docs" / "strategies" / "pipeline.md"
BEGIN, END = "<!-- bench/pipeline_split.py begin -->", "<!-- bench/pipeline_split.py end -->"
WIDTH, BATCH, MICROBATCHES = 8192, 256, 4
SPLITS = {"balanced (no split points)": (), "equal block counts": ("blocks.2",)}


def step_of(points: tuple[str, ...], batch: tuple) -> tuple:
    """A step of the model cut at ``points`` (none: balanced), and the split it chose with its estimates."""
    torch.manual_seed(0)
    model = UnevenMLP(WIDTH)
    pipeline = PipelineParallel(stages=2, microbatches=MICROBATCHES, split_points=points)
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.01), "none", nn.functional.mse_loss, batch,
                     pipeline=pipeline)  # fmt: skip
    decision = step.program.decisions.get("balanced-split", f"split points {list(points)}")
    return (lambda: step(*batch)), decision


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 16, generator=gen))
    runs, decisions = {}, {}
    for label, points in SPLITS.items():
        runs[label], decisions[label] = step_of(points, batch)
        runs[label]()
    finish_rank(out, {"ms": interleaved_ms(runs), "decisions": decisions})


def render(ranks: list[dict]) -> str:
    slowest = {label: max(statistics.median(r["ms"][label]) for r in ranks) for label in SPLITS}
    equal = slowest["equal block counts"]
    lines = [
        f"`{COMMAND}` on {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}; 2 stages, "
        f"{MICROBATCHES} microbatches, 1F1B:",
        "",
        "| split | what it chose (rank 0's estimate) | ms per step (median, slowest rank) | vs equal counts |",
        "|---|---|---|---|",
    ]
    for label in SPLITS:
        chosen = ranks[0]["decisions"][label]
        lines.append(f"| {label} | {chosen} | {slowest[label]:.1f} | {slowest[label] / equal:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    table = render(two_rank_results(__file__, lambda out, _: [out], 29760))
    print(table)
    write_section(DOC, BEGIN, END, table)


if __name__ == "__main__":
    entry(rank_main, main)
