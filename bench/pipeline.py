"""Pipeline parallelism on the CPU: the traced step's stages (``transpile(..., pipeline=PipelineParallel(...))``)
against ``torch.distributed.pipelining`` with the same split, schedule, microbatches, loss and optimizer, in one
run per stage count.

    python -m bench.pipeline           # 2 and 4 stages; GPipe, 1F1B, ZB-H1, interleaved 1F1B; 4 and 8 microbatches
    python -m bench.pipeline --stages 2 --microbatches 4
    python -m bench.pipeline --compile --stages 2 --microbatches 4   # ours compiled (Inductor), its own table

Model: a GPT of 8 blocks (width 64, 4 heads, sequence 32), batch 16, AdamW; one process per stage, one thread
each. torch's side is a hand-built ``PipelineStage`` per rank holding the same modules (``bench/models.py``'s
``NarrowGPTStage``), its schedule's ``step``, then torch's AdamW (``foreach=False``, the traced update's arithmetic)
on the stage's parameters; for ZB-H1, torch's 1F1B (its zero-bubble schedules run several stages per rank); for
interleaved 1F1B (2 chunks per rank), ``ScheduleInterleaved1F1B`` over a ``PipelineStage`` per chunk. Per
row: the median step time over interleaved rounds (``bench/host_ops.py``; the
slowest rank's), the ratio of ours to torch's, the **bubble** of each rank (the share of its step it spends
waiting for a peer: ours, the time inside ``transpiler::recv``, ``wait_sends`` and the loss's all-reduce, from the
profiler; torch's, the time inside its schedules' ``_wait_batch_p2p``, timed by wrapping it) against the
schedule's theory (p−1)/(m+p−1), the work ops one step dispatches (``bench/op_count.py``) and the peak bytes a
step allocates above what it holds (the profiler's allocation records), per stage.

On a 2-core machine 4 stages share 2 cores: a rank that waits gives its core to another, and the bubble then
counts time it could not have run anyway. The table says which machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.host_ops import interleaved_ms
from bench.models import NarrowGPT, NarrowGPTStage, narrow_batch, pipelining_step
from bench.op_count import count_ops
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import Execution, PipelineParallel, transpile
from transpiler.runtime.allocations import allocated_peak

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m bench.pipeline"
DOC = ROOT / "docs" / "strategies" / "pipeline.md"
BEGIN, END = "<!-- bench/pipeline.py begin -->", "<!-- bench/pipeline.py end -->"
COMPILED = "<!-- bench/pipeline.py --compile begin -->", "<!-- bench/pipeline.py --compile end -->"
BLOCKS, DIM, HEADS, BATCH = 8, 64, 4, 16
VIRTUAL = 2  # chunks per rank under interleaved 1F1B
WAITS = ("transpiler::recv", "transpiler::wait_sends", "_c10d_functional::wait_tensor")


def base_model() -> NarrowGPT:
    torch.manual_seed(0)
    return NarrowGPT(blocks=BLOCKS, dim=DIM, heads=HEADS, seq=16)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


class TorchStage:
    """``torch.distributed.pipelining``'s stage of this rank, its schedule and its optimizer; the time it waits
    for peers is summed in ``waited`` (seconds)."""

    def __init__(self, rank: int, world: int, schedule: str, microbatches: int, batch: tuple) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.rank, self.world, self.batch, self.microbatches = rank, world, batch, microbatches
        model = base_model()
        if schedule == "interleaved_1f1b":
            chunks = VIRTUAL * world
            mine = range(rank, chunks, world)
            modules = [NarrowGPTStage(model, c, chunks) for c in mine]
            stages = [PipelineStage(m, c, chunks, torch.device("cpu")) for m, c in zip(modules, mine)]
            self.schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
            self.optimizer = adamw([p for m in modules for p in m.parameters()])
            return
        module = NarrowGPTStage(model, rank, world)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(PipelineStage(module, rank, world, torch.device("cpu")), microbatches, loss_fn=loss_fn)
        self.optimizer = adamw(module.parameters())

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        pipelining_step(self.schedule, self.rank, self.world, self.batch, self.microbatches)
        self.optimizer.step()


class WaitClock:
    """Wraps torch's schedules' ``_wait_batch_p2p`` to sum the seconds spent inside it."""

    def __init__(self) -> None:
        from torch.distributed.pipelining import schedules

        self.module, self.original, self.waited = schedules, schedules._wait_batch_p2p, 0.0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.waited += time.perf_counter() - start

        schedules._wait_batch_p2p = timed


def our_step(world: int, schedule: str, microbatches: int, batch: tuple):
    model = base_model()
    virtual = VIRTUAL if schedule == "interleaved_1f1b" else 1
    chunks = virtual * world  # the split torch's side has: equal block counts
    points = tuple(f"blocks.{k * BLOCKS // chunks}" for k in range(1, chunks))
    pipeline = PipelineParallel(
        stages=world, microbatches=microbatches, schedule=schedule, virtual_stages=virtual, split_points=points
    )
    config = os.environ.get("BENCH_CONFIG", "fused_allreduce")
    execution = Execution(compile=bool(os.environ.get("BENCH_COMPILE")))
    step = transpile(model, adamw(model.parameters()), config, loss_fn, batch, pipeline=pipeline, execution=execution)
    return lambda: step(*batch)


def our_bubble(run, steps: int = 3) -> float:
    """The share of a step this rank spends waiting for peers, from the profiler's op records."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        total = time.perf_counter() - start
    waited = sum(e.cpu_time_total for e in profile.key_averages() if e.key in WAITS) / 1e6
    return waited / total


def torch_bubble(run, clock: WaitClock, steps: int = 3) -> float:
    clock.waited = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return clock.waited / (time.perf_counter() - start)


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(m) for m in os.environ["BENCH_MICROBATCHES"].split(",")]
    batch = narrow_batch("gpt", BATCH, torch.Generator().manual_seed(0))
    clock = WaitClock()
    result = {}
    for m in counts:
        for schedule in ("gpipe", "1f1b", "zbh1", "interleaved_1f1b"):
            if schedule == "1f1b" and m < world or schedule == "interleaved_1f1b" and m % world:
                continue
            peer = "1f1b" if schedule == "zbh1" else schedule  # torch's zero-bubble schedules are interleaved ones
            runs = {"ours": our_step(world, schedule, m, batch), "torch": TorchStage(rank, world, peer, m, batch)}
            for run in runs.values():
                run()
            times = interleaved_ms(runs)
            row = {label: {"ms": times[label]} for label in runs}
            row["ours"]["bubble"] = our_bubble(runs["ours"])
            row["torch"]["bubble"] = torch_bubble(runs["torch"], clock)
            compiled = bool(os.environ.get("BENCH_COMPILE"))
            for label, run in runs.items():  # a compiled program runs under no dispatch mode: its ops go uncounted
                row[label]["work"] = "–" if compiled and label == "ours" else count_ops(run).work
                dist.barrier()
                row[label]["peak"] = allocated_peak(run)
            result[f"{schedule} m={m}"] = row
    finish_rank(out, result)


def theory(schedule: str, stages: int, microbatches: int) -> float:
    """The share of a step a stage idles: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(3m+p−1) for ZB-H1 (forward,
    input and weight gradients taking alike), (p−1)/(vm+p−1) for interleaved 1F1B with v chunks per rank."""
    if schedule == "zbh1":
        return (stages - 1) / (3 * microbatches + stages - 1)
    if schedule == "interleaved_1f1b":
        return (stages - 1) / (VIRTUAL * microbatches + stages - 1)
    return (stages - 1) / (microbatches + stages - 1)


def slowest(per_rank: list[list[float]]) -> float:
    """The median over rounds of the slowest rank's time in each round."""
    return statistics.median(max(values) for values in zip(*per_rank))


def render(results: dict[int, list[dict]], compiled: bool = False) -> str:
    command = f"`{COMMAND} --compile` (ours with compile=True, its ops not counted)" if compiled else f"`{COMMAND}`"
    lines = [
        f"{command} on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; GPT {BLOCKS} blocks × width {DIM}, batch {BATCH}, AdamW. Step time: the median over "
        "rounds of the slowest rank; bubble: each rank's share of the step spent waiting for a peer, rank 0 … "
        "p−1; peak: the most a step allocates above what it holds, per stage, KiB.",
        "",
        "| stages | schedule | ours ms | torch ms | ours / torch | theory bubble | ours bubble | torch bubble "
        "| ours work ops | torch work ops | ours peak KiB | torch peak KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stages, ranks in results.items():
        for key in ranks[0]:
            schedule, m = key.split(" m=")

            ours, theirs = (slowest([r[key][label]["ms"] for r in ranks]) for label in ("ours", "torch"))
            bubbles = {
                label: " / ".join(f"{r[key][label]['bubble']:.2f}" for r in ranks) for label in ("ours", "torch")
            }
            work = {label: " / ".join(str(r[key][label]["work"]) for r in ranks) for label in ("ours", "torch")}
            peak = {
                label: " / ".join(f"{r[key][label]['peak'] / 1024:.0f}" for r in ranks) for label in ("ours", "torch")
            }
            peer = " (torch: 1f1b)" if schedule == "zbh1" else ""
            lines.append(
                f"| {stages} | {schedule}, m={m}{peer} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} | "
                f"{theory(schedule, stages, int(m)):.2f} | {bubbles['ours']} | {bubbles['torch']} | {work['ours']} | "
                f"{work['torch']} | {peak['ours']} | {peak['torch']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--compile", action="store_true", help="ours with compile=True (its own table in the docs)")
    args = parser.parse_args()
    os.environ["BENCH_MICROBATCHES"] = ",".join(map(str, args.microbatches))
    if args.compile:
        os.environ["BENCH_COMPILE"] = "1"
    results = {}
    for port, stages in enumerate(args.stages):
        results[stages] = two_rank_results(__file__, lambda out, _: [out], 29710 + port, world=stages)
    table = render(results, args.compile)
    print(table)
    write_section(DOC, *(COMPILED if args.compile else (BEGIN, END)), table)


if __name__ == "__main__":
    entry(rank_main, main)
