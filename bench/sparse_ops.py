"""DeMo's and SparseLoCo's exchange beside DDP on the 1.8M-parameter GPT of ``bench/wan.py``: ops and step time.

    python -m bench.sparse_ops              # one torchrun world of 2 over gloo, about 2 minutes
    python -m bench.sparse_ops --compiled   # both modes compiled beside uncompiled, about 10 minutes

Each writes its table into docs/performance.md.

Issue 77's figures for the two modes whose exchanges are their authors' arithmetic: each rank builds every
variant from the same weights (``bench/planner_worker.py``'s GPT and batches), counts the aten ops of one step
after warm-up (``bench/op_count.py``, which counts the ops inside the exchange's custom ops too), then times the
variants interleaved, round by round (``bench/host_ops.py``'s loop). DDP and ``fused_allreduce`` step AdamW;
``demo`` steps SGD on the exchanged sign, beside its authors' optimizer in their loop (``bench/demo_peer.py``);
``sparseloco`` syncs every step here (``sync_every=1``), so its row is an inner step and a sync. With
``--compiled`` the two modes run ``compile=True`` beside their uncompiled programs (times only: Dynamo refuses
the op counter around a compiled call), each with its first call's seconds (compiling included). Nothing here is
a test.
"""

from __future__ import annotations

import copy
import statistics
import sys
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
from transpiler import Execution, transpile
from transpiler.strategies.modes import mode_config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- sparse_ops -->", "<!-- /sparse_ops -->"
COMPILED_BEGIN, COMPILED_END = "<!-- sparse_ops_compiled -->", "<!-- /sparse_ops_compiled -->"
REFERENCE = "DDP (AdamW)"
AUTHORS_DEMO = "the authors' DeMo (bloc97, eager)"
VARIANTS = (REFERENCE, "fused_allreduce", AUTHORS_DEMO, "demo", "sparseloco (sync_every=1)")
COMPILED = ("demo", "sparseloco (sync_every=1)")  # with --compiled: each uncompiled and compile=True


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
        transpiled = _transpiled(label, model, loss_fn, batch)
        runs[label] = lambda transpiled=transpiled: transpiled(*batch)
    return runs


def _transpiled(label: str, model: torch.nn.Module, loss_fn, batch, compiled: bool = False):
    """``demo`` (SGD), ``sparseloco`` (AdamW, syncing every step) or ``fused_allreduce`` (AdamW) on ``model``."""
    mode = label.split()[0]
    config = mode_config("sparseloco", sync_every=1) if mode == "sparseloco" else mode
    optimizer = (torch.optim.SGD if mode == "demo" else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    return transpile(model, optimizer, config, loss_fn, batch, execution=Execution(compile=compiled))


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))  # a compile may keep one rank a few minutes
    torch.set_num_threads(1)
    if "--compiled" in sys.argv:
        finish_rank(out, compiled_rank(dist.get_rank()))
    runs = build_variants(dist.get_rank())
    counts = {}
    for label, run in runs.items():
        for _ in range(WARMUP):
            run()
        counter = count_ops(run)
        counts[label] = {"work": counter.work, "views": counter.views}
    times = interleaved_ms(runs)
    finish_rank(out, {"counts": counts, "ms": {label: statistics.median(t) for label, t in times.items()}})


def compiled_rank(rank: int) -> dict:
    """Each of :data:`COMPILED` uncompiled and compiled from the same weights: the compiled one's first call (its
    compile) timed, then both timed interleaved."""
    base, _, loss_fn, make = factory("gpt")
    batch = make(torch.Generator().manual_seed(rank), 1)
    runs, seconds = {}, {}
    for label in COMPILED:
        for compiled in (False, True):
            step = _transpiled(label, copy.deepcopy(base), loss_fn, batch, compiled)
            name = f"{label}, compile={compiled}"
            runs[name] = lambda step=step: step(*batch)
            runs[name]()
            seconds[name] = sum(step.compile_seconds.values()) if compiled else 0.0
    times = interleaved_ms(runs)
    return {"ms": {name: statistics.median(t) for name, t in times.items()}, "compile_s": seconds}


def table(ranks: list[dict]) -> str:
    counts = ranks[0]["counts"]
    ms = {label: max(r["ms"][label] for r in ranks) for label in VARIANTS}
    lines = ["| variant | work ops | view ops | step ms | × DDP |", "|---|---:|---:|---:|---:|"]
    for label in VARIANTS:
        c = counts[label]
        lines.append(f"| {label} | {c['work']} | {c['views']} | {ms[label]:.1f} | {ms[label] / ms[REFERENCE]:.2f} |")
    return "\n".join(lines) + "\n"


def compiled_table(ranks: list[dict]) -> str:
    lines = ["| mode | uncompiled ms | compiled ms | × uncompiled | compile s |", "|---|---:|---:|---:|---:|"]
    for label in COMPILED:
        eager, built = (max(r["ms"][f"{label}, compile={c}"] for r in ranks) for c in (False, True))
        compile_s = max(r["compile_s"][f"{label}, compile=True"] for r in ranks)
        lines.append(f"| {label} | {eager:.1f} | {built:.1f} | {built / eager:.2f} | {compile_s:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    compiled = "--compiled" in sys.argv
    ranks = two_rank_results(__file__, lambda out, _: [out] + (["--compiled"] if compiled else []), port=29589)
    setting = f"W=2 over gloo, one thread per rank, torch {torch.__version__}"
    if compiled:
        body = (
            f"`python -m bench.sparse_ops --compiled` ({setting}; step ms: median over {ROUNDS} rounds of {STEPS} "
            "steps, the slower rank; compile s: the compiled step's first call, the slower rank):\n\n"
            + compiled_table(ranks)
        )
        begin, end = COMPILED_BEGIN, COMPILED_END
    else:
        body = (
            f"`python -m bench.sparse_ops` ({setting}; ops of one step on rank 0; step ms: median over {ROUNDS} "
            f"rounds of {STEPS} steps, the slower rank):\n\n" + table(ranks)
        )
        begin, end = BEGIN, END
    print(body)
    write_section(DOC, begin, end, body)


if __name__ == "__main__":
    entry(rank_main, main)
