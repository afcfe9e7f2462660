"""Pipeline parallelism on the CPU: the traced step's stages (``transpile(..., pipeline=PipelineParallel(...))``)
against ``torch.distributed.pipelining`` with the same split, schedule, microbatches, loss and optimizer, in one
run per stage count.

    python -m bench.pipeline           # 2 and 4 stages; GPipe, 1F1B, ZB-H1, interleaved 1F1B; 4 and 8 microbatches
    python -m bench.pipeline --stages 2 --microbatches 4
    python -m bench.pipeline --compile --stages 2 --microbatches 4   # ours compiled (Inductor), its own table

Model: a GPT of 8 blocks (width 64, 4 heads, sequence 32), batch 16, AdamW; one process per stage, one thread
each. torch's side is a hand-built ``PipelineStage`` per rank holding the same modules (``bench/models.py``'s
``NarrowGPTStage``), its schedule's ``step``, then torch's AdamW (``foreach=False``, the traced update's arithmetic)
on the stage's parameters; for ZB-H1, ``ScheduleInterleavedZeroBubble`` over the rank's one stage (its order at
one stage per rank is ZB-H1's, action for action); for interleaved 1F1B (2 chunks per rank),
``ScheduleInterleaved1F1B`` over a ``PipelineStage`` per chunk. Per row: the median step time over interleaved
rounds (``bench/host_ops.py``; the slowest rank's), the ratio of ours to torch's, the **bubble** of each rank (the
share of a step its thread did not run, from ``time.thread_time`` around each of 12 steps after a barrier, against
the slowest rank's wall time: waiting inside a receive or a collective, or done before the slowest rank; the same
measure for both sides, without a profiler) against the schedule's theory, the work ops one step dispatches
(``bench/op_count.py``), the bytes it hands gloo to send (the profiler's ``gloo:send`` records) and the peak bytes a
step allocates above what it holds (the profiler's allocation records), per stage.

On a 2-core machine 4 stages share 2 cores: a rank also waits for a core, which the bubble counts too (four
ranks on two cores idle half the time at least). The table says which machine it ran on.
"""

from __future__ import annotations

import argparse
import math
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


def base_model() -> NarrowGPT:
    torch.manual_seed(0)
    return NarrowGPT(blocks=BLOCKS, dim=DIM, heads=HEADS, seq=16)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


class TorchStage:
    """``torch.distributed.pipelining``'s stage of this rank, its schedule and its optimizer."""

    def __init__(self, rank: int, world: int, schedule: str, microbatches: int, batch: tuple) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

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
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        if schedule == "zbh1":
            self.schedule = ScheduleInterleavedZeroBubble([stage], microbatches, loss_fn=loss_fn)
        else:
            self.schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
                stage, microbatches, loss_fn=loss_fn
            )
        self.optimizer = adamw(module.parameters())

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        pipelining_step(self.schedule, self.rank, self.world, self.batch, self.microbatches)
        self.optimizer.step()


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


def idle_rounds(runs: dict, rounds: int = 12) -> dict[str, list[tuple[float, float]]]:
    """Per variant, ``rounds`` steps each after a barrier (the variants in turn): the step's wall seconds on this
    rank and the seconds its thread ran (``time.thread_time``; a thread blocked in a receive or a collective does
    not run). Across ranks, a rank's idle share of a step is 1 − ran / the slowest rank's wall time."""
    out: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            dist.barrier()
            wall, ran = time.perf_counter(), time.thread_time()
            run()
            out[label].append((time.perf_counter() - wall, time.thread_time() - ran))
    return out


def sent_bytes(run) -> int:
    """The bytes one step hands gloo to send (its ``gloo:send`` records' shapes; the bench's model is float32)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        run()
    return sum(4 * math.prod(e.input_shapes[0]) for e in profile.events() if e.name == "gloo:send")


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(m) for m in os.environ["BENCH_MICROBATCHES"].split(",")]
    batch = narrow_batch("gpt", BATCH, torch.Generator().manual_seed(0))
    result = {}
    for m in counts:
        for schedule in ("gpipe", "1f1b", "zbh1", "interleaved_1f1b"):
            if schedule == "1f1b" and m < world or schedule == "interleaved_1f1b" and m % world:
                continue
            runs = {"ours": our_step(world, schedule, m, batch), "torch": TorchStage(rank, world, schedule, m, batch)}
            for run in runs.values():
                run()
            times = interleaved_ms(runs)
            row = {label: {"ms": times[label]} for label in runs}
            for label, rounds in idle_rounds(runs).items():
                row[label]["rounds"] = rounds
            compiled = bool(os.environ.get("BENCH_COMPILE"))
            for label, run in runs.items():  # a compiled program runs under no dispatch mode: its ops go uncounted
                row[label]["work"] = "–" if compiled and label == "ours" else count_ops(run).work
                row[label]["sent"] = sent_bytes(run)
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


def idle(per_rank: list[list[tuple[float, float]]]) -> list[float]:
    """Each rank's median share of a step it did not run: 1 − its thread's seconds / the slowest rank's wall."""
    slowest_wall = [max(wall for wall, _ in step) for step in zip(*per_rank)]
    return [statistics.median(1 - ran / w for (_, ran), w in zip(rounds, slowest_wall)) for rounds in per_rank]


def slowest(per_rank: list[list[float]]) -> float:
    """The median over rounds of the slowest rank's time in each round."""
    return statistics.median(max(values) for values in zip(*per_rank))


def render(results: dict[int, list[dict]], compiled: bool = False) -> str:
    command = f"`{COMMAND} --compile` (ours with compile=True, its ops not counted)" if compiled else f"`{COMMAND}`"
    lines = [
        f"{command} on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; GPT {BLOCKS} blocks × width {DIM}, batch {BATCH}, AdamW. Step time: the median over "
        "rounds of the slowest rank; bubble: each rank's share of the step its thread did not run (waiting for a "
        "peer, or done before the slowest rank), rank 0 … "
        "p−1; KiB sent: what one step hands gloo to send, per stage; peak: the most a step allocates above what it "
        "holds, per stage, KiB.",
        "",
        "| stages | schedule | ours ms | torch ms | ours / torch | theory bubble | ours bubble | torch bubble "
        "| ours work ops | torch work ops | ours KiB sent | torch KiB sent | ours peak KiB | torch peak KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stages, ranks in results.items():
        for key in ranks[0]:
            schedule, m = key.split(" m=")

            ours, theirs = (slowest([r[key][label]["ms"] for r in ranks]) for label in ("ours", "torch"))
            bubbles = {
                label: " / ".join(f"{b:.2f}" for b in idle([r[key][label]["rounds"] for r in ranks]))
                for label in ("ours", "torch")
            }
            work = {label: " / ".join(str(r[key][label]["work"]) for r in ranks) for label in ("ours", "torch")}
            peak, sent = (
                {label: " / ".join(f"{r[key][label][what] / 1024:.0f}" for r in ranks) for label in ("ours", "torch")}
                for what in ("peak", "sent")
            )
            lines.append(
                f"| {stages} | {schedule}, m={m} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} | "
                f"{theory(schedule, stages, int(m)):.2f} | {bubbles['ours']} | {bubbles['torch']} | {work['ours']} | "
                f"{work['torch']} | {sent['ours']} | {sent['torch']} | {peak['ours']} | {peak['torch']} |"
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
