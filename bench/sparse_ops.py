"""DeMo's and SparseLoCo's exchange beside DDP on the 1.8M-parameter GPT of ``bench/wan.py``: ops and step time.

    python -m bench.sparse_ops      # one torchrun world of 2 over gloo, about 2 minutes; writes docs/performance.md

Issue 77's figures for the two modes whose exchanges are their authors' arithmetic: each rank builds every
variant from the same weights (``bench/planner_worker.py``'s GPT and batches), counts the aten ops of one step
after warm-up (``bench/op_count.py``, which counts the ops inside the exchange's custom ops too), then times the
variants interleaved, round by round (``bench/host_ops.py``'s loop). DDP and ``fused_allreduce`` step AdamW;
``demo`` steps SGD on the exchanged sign, beside its authors' optimizer in their loop (``bench/demo_peer.py``);
``sparseloco`` syncs every step here (``sync_every=1``), so its row is an inner step and a sync. Nothing here is a
test.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.demo_peer import AuthorsDeMo
from bench.host_ops import ROUNDS, STEPS, WARMUP, interleaved_ms
from bench.op_count import count_ops
from bench.planner_worker import factory
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import transpile
from transpiler.strategies.modes import mode_config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- sparse_ops -->", "<!-- /sparse_ops -->"
REFERENCE = "DDP (AdamW)"
AUTHORS_DEMO = "the authors' DeMo (bloc97, eager)"
VARIANTS = (REFERENCE, "fused_allreduce", AUTHORS_DEMO, "demo", "sparseloco (sync_every=1)")


def build_variants(rank: int) -> dict[str, Callable[[], object]]:
    """One step function per variant, each on its own copy of the same weights and one batch of this rank's."""
    base, _, loss_fn, make = factory("gpt")
    batch = make(torch.Generator().manual_seed(rank), 1)
    runs: dict[str, Callable[[], object]] = {}
    for label in VARIANTS:
        model = copy.deepcopy(base)
        if label in (REFERENCE, AUTHORS_DEMO):  # eager: DDP, or DeMo's own loop (its gradients never all-reduced)
            net = DDP(model) if label == REFERENCE else model
            optimizer = (
                torch.optim.AdamW(net.parameters(), lr=1e-3)
                if label == REFERENCE
                else AuthorsDeMo(net.parameters(), lr=1e-3)
            )

            def step(net=net, optimizer=optimizer) -> None:
                optimizer.zero_grad()
                loss_fn(net(batch[0]), batch[1]).backward()
                optimizer.step()

            runs[label] = step
            continue
        mode = label.split()[0]
        config = mode_config("sparseloco", sync_every=1) if mode == "sparseloco" else mode
        optimizer = (torch.optim.SGD if mode == "demo" else torch.optim.AdamW)(model.parameters(), lr=1e-3)
        transpiled = transpile(model, optimizer, config, loss_fn, batch)
        runs[label] = lambda transpiled=transpiled: transpiled(*batch)
    return runs


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    runs = build_variants(dist.get_rank())
    counts = {}
    for label, run in runs.items():
        for _ in range(WARMUP):
            run()
        counter = count_ops(run)
        counts[label] = {"work": counter.work, "views": counter.views}
    times = interleaved_ms(runs)
    finish_rank(out, {"counts": counts, "ms": {label: statistics.median(t) for label, t in times.items()}})


def table(ranks: list[dict]) -> str:
    counts = ranks[0]["counts"]
    ms = {label: max(r["ms"][label] for r in ranks) for label in VARIANTS}
    lines = ["| variant | work ops | view ops | step ms | × DDP |", "|---|---:|---:|---:|---:|"]
    for label in VARIANTS:
        c = counts[label]
        lines.append(f"| {label} | {c['work']} | {c['views']} | {ms[label]:.1f} | {ms[label] / ms[REFERENCE]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, _: [out], port=29589)
    body = (
        f"`python -m bench.sparse_ops` (W=2 over gloo, one thread per rank, torch {torch.__version__}; ops of one "
        f"step on rank 0; step ms: median over {ROUNDS} rounds of {STEPS} steps, the slower rank):\n\n" + table(ranks)
    )
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    entry(rank_main, main)
