"""One step of each schedule as each rank ran it: a timeline figure per schedule (docs/strategies/
pipeline_timeline.png).

    python -m bench.pipeline_timeline

The GPT of ``bench/pipeline.py`` (8 blocks × width 64, batch 16, AdamW, ``fused_allreduce`` at dp = 1), 2 stages
× 4 microbatches under GPipe, 1F1B, ZB-H1 and interleaved 1F1B (2 chunks per rank); one process and one thread
per rank. After warm steps and a barrier, each rank runs one step's program node by node under an
``fx.Interpreter`` that reads the clock around every node (its own few µs per node make the bars a little longer
than in a plain step), and the nodes are grouped by the action of the schedule they belong to (``meta["action"]``,
written by ``split-stages``: ``F3``, ``B3``, ``W3``, ``F3.c2``); a receive, the sends' wait and the loss's
all-reduce are drawn apart, as the time the rank waited for its peers. The run also prints each schedule's step
time under the interpreter and each rank's share of it spent waiting.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx

from bench.models import narrow_batch
from bench.pipeline import BATCH, BLOCKS, VIRTUAL, adamw, base_model, loss_fn
from bench.two_ranks import entry, finish_rank, two_rank_results
from transpiler import PipelineParallel, transpile
from transpiler.graph.stage_ops import RECV, WAIT_SENDS

ROOT = Path(__file__).resolve().parent.parent
FIGURE = ROOT / "docs" / "strategies" / "pipeline_timeline.png"
SCHEDULES = ("gpipe", "1f1b", "zbh1", "interleaved_1f1b")
MICROBATCHES = 4
COLOURS = {
    "F": "tab:blue",
    "B": "tab:orange",
    "W": "tab:green",
    "wait": "lightgrey",
    "update": "tab:purple",
    "once": "tab:brown",
}
WAITS = (RECV, WAIT_SENDS, torch.ops._c10d_functional.wait_tensor.default)


class ClockedInterpreter(fx.Interpreter):
    """Runs a program node by node, recording each node's start and end (seconds from the run's start) and what
    it is: ``wait`` (a receive, the sends' wait, the loss's all-reduce), ``update`` (the optimizer), ``once`` (what
    the step makes once before its first action: views of the flat buffers, the weights' transposes), else its
    action (``meta["action"]``; a node without one, such as a microbatch's slice of the batch or a gradient's
    running sum, goes with the action before it)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.spans: list[tuple[float, float, str]] = []
        self.start, self.action = 0.0, ""

    def run(self, *args, **kwargs):
        self.spans, self.start, self.action = [], time.perf_counter(), ""
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node):
        begin = time.perf_counter()
        out = super().run_node(n)
        if n.op == "call_function":
            self.action = n.meta.get("action", self.action)
            if n.target in WAITS:
                what = "wait"
            elif n.meta.get("role") == "optimizer":
                what = "update"
            else:
                what = self.action or "once"
            self.spans.append((begin - self.start, time.perf_counter() - self.start, what))
        return out


def merged(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Consecutive spans of the same action as one (from the first's start to the last's end)."""
    out: list[tuple[float, float, str]] = []
    for begin, end, what in spans:
        if out and out[-1][2] == what:
            out[-1] = (out[-1][0], end, what)
        else:
            out.append((begin, end, what))
    return out


def timed_step(schedule: str, batch: tuple) -> dict:
    world = dist.get_world_size()
    virtual = VIRTUAL if schedule == "interleaved_1f1b" else 1
    chunks = virtual * world
    points = tuple(f"blocks.{k * BLOCKS // chunks}" for k in range(1, chunks))
    model = base_model()
    pipeline = PipelineParallel(
        stages=world, microbatches=MICROBATCHES, schedule=schedule, virtual_stages=virtual, split_points=points
    )
    step = transpile(model, adamw(model.parameters()), "fused_allreduce", loss_fn, batch, pipeline=pipeline)
    for _ in range(3):
        step(*batch)
    built = step._state.built  # the bench's look inside: the program the step runs, run by the interpreter
    clocked = ClockedInterpreter(built.programs["step"].graph_module)
    built.runners["step"] = clocked.run
    step(*batch)  # warm under the interpreter
    dist.barrier()
    step(*batch)
    spans = merged(clocked.spans)
    total = spans[-1][1]
    waited = sum(end - begin for begin, end, what in spans if what == "wait")
    return {"spans": spans, "ms": total * 1e3, "waited": waited / total}


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    batch = narrow_batch("gpt", BATCH, torch.Generator().manual_seed(0))
    finish_rank(out, {schedule: timed_step(schedule, batch) for schedule in SCHEDULES})


def figure(ranks: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(12, 1.3 * len(SCHEDULES) * len(ranks) / 2 + 1.5))
    for ax, schedule in zip(axes, SCHEDULES):
        for rank, result in enumerate(ranks):
            for begin, end, what in result[schedule]["spans"]:
                kind = what if what in ("wait", "update", "once") else what[:1]
                ax.broken_barh([(begin * 1e3, (end - begin) * 1e3)], (rank - 0.4, 0.8), color=COLOURS[kind])
                if kind in ("F", "B", "W") and (end - begin) * 1e3 > 1.2:
                    ax.text((begin + end) / 2 * 1e3, rank, what[1:], ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
        ax.invert_yaxis()
        ax.set_title(f"{schedule}, {MICROBATCHES} microbatches", fontsize=9, loc="left")
    axes[-1].set_xlabel("ms from the step's start (each rank's own clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    names = [
        "forward",
        "backward (input gradient under ZB-H1)",
        "weights' gradients",
        "waiting for a peer",
        "update",
        "once a step: views, transposes",
    ]
    fig.legend(handles, names, loc="lower center", ncol=6, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(FIGURE, dpi=110)


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, _: [out], 29780)
    for schedule in SCHEDULES:
        waits = " / ".join(f"{r[schedule]['waited']:.2f}" for r in ranks)
        print(f"{schedule}: {max(r[schedule]['ms'] for r in ranks):.1f} ms under the interpreter; waiting {waits}")
    figure(ranks)
    print(f"wrote {FIGURE.relative_to(ROOT)}")


if __name__ == "__main__":
    entry(rank_main, main)
