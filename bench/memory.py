"""Bytes per rank and step time: DDP, ``fused_allreduce``, ``zero1``, ``zero2`` and ``zero3``, at 2 and 4 processes.

    python -m bench.memory            # launches torchrun at W=2 and W=4 over gloo, writes docs/memory.md
    python -m bench.memory --return-freed-memory   # the same with Execution(keep_freed_memory=False) (its own table)

Each rank builds every variant from the same weights (AdamW, the 5M-parameter MLP of bench/models.py), runs the
variants interleaved round by round, and reports the median step time over rounds and the bytes it holds
between steps, counted from the tensors held (``step.memory_report()``; for DDP the same counter over its
parameters, its gradients, which are views of its buckets, and its optimizer state). It then times ``zero1``'s
bucket collectives alone (all-reduce, reduce-scatter, all-gather), to say how much of zero's extra step time is
communication. By default ``transpile()`` has glibc keep the memory a step frees (``Execution(keep_freed_memory=True)``,
``transpiler/runtime/host_memory.py``), which DDP in the same process then has too;
``--return-freed-memory`` passes ``Execution(keep_freed_memory=False)`` to every variant, so glibc returns large freed
blocks to the kernel as it comes, and the buffers a step allocates (zero's all-to-all receive buffers,
``zero2``'s buckets) fault their pages in again. Nothing here is a test.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.models import batch_for, build
from transpiler import Execution, mode_config, transpile
from transpiler.graph.memory import peak_transient_bytes
from transpiler.runtime.memory_report import StorageCounter

ROOT = Path(__file__).resolve().parent.parent

MODEL, PER_RANK, WARMUP, STEPS, ROUNDS = "mlp_5m", 32, 2, 5, 9
# label -> (mode, options); zero3's default units are a layer each here (bucket_cap_mb=cost: the MLP's layers of
# 2 and 8 MiB are above the n½ measured on 2 cores, so each starts a unit); with DDP's 25 MB cap its two big
# layers share one bucket, gathered whole
VARIANTS: dict[str, tuple[str, dict]] = {
    "ddp": ("ddp", {}),
    "fused_allreduce": ("fused_allreduce", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "zero3, no reshard": ("zero3", {"reshard_after_forward": False}),
    "zero3, 25 MB buckets": ("zero3", {"bucket_cap_mb": 25}),
}
COMMAND = "python -m bench.memory"
RETURN_FREED = "--return-freed-memory"
# where each configuration's table starts in docs/memory.md; each runs to the next marker or the end
MARKERS = {False: "<!-- table -->", True: "<!-- table: glibc returns freed memory -->"}
MIB = 1024 * 1024
HEADER = "# Memory per rank: DDP, fused_allreduce, zero1, zero2, zero3\n\n"


def is_parameter_gather(node: torch.fx.Node) -> bool:
    """An all-gather of zero3's parameters (its result is a whole bucket)."""
    return node.meta.get("collective", {}).get("kind") == "all_gather" and "phase" in node.meta["collective"]


def ddp_bytes(model: DDP, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    counter = StorageCounter()
    params = list(model.parameters())
    return {
        "parameters": counter.count(params),
        "gradients": counter.count(p.grad for p in params),
        "optimizer_state": counter.count(t for s in optimizer.state.values() for t in s.values()),
        "peak": 0,
    }


def rank_main(out: str, return_freed: bool) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = build(MODEL)
    gen = torch.Generator().manual_seed(rank)
    batch = batch_for(MODEL, PER_RANK, gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps, transpiled = {}, {}
    for variant, (mode, options) in VARIANTS.items():
        model = copy.deepcopy(base)
        if variant == "ddp":
            model = DDP(model, gradient_as_bucket_view=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def run(model=model, optimizer=optimizer) -> None:
                optimizer.zero_grad(set_to_none=False)
                loss_fn(model(batch[0]), batch[1]).backward()
                optimizer.step()

            steps[variant] = (run, lambda model=model, optimizer=optimizer: ddp_bytes(model, optimizer))
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            keep = not return_freed
            step = transpile(
                model,
                optimizer,
                mode_config(mode, **options),
                loss_fn=loss_fn,
                execution=Execution(keep_freed_memory=keep),
            )
            transpiled[variant] = step

            def report(step=step) -> dict[str, int]:
                r = step.memory_report()
                buckets = sorted((b.length * 4 for b in step.program.param_buckets), reverse=True)
                return {
                    **{k: getattr(r, k) for k in ("parameters", "gradients", "optimizer_state", "peak")},
                    "two_buckets": sum(buckets[:2]),
                    "gathered_peak": peak_transient_bytes(step.program.graph, is_parameter_gather),
                }

            steps[variant] = (lambda step=step: step(*batch), report)
    times = interleaved_ms({v: run for v, (run, _) in steps.items()}, WARMUP)
    result = {v: {"ms": statistics.median(times[v]), "rounds": times[v], **steps[v][1]()} for v in VARIANTS}
    result["psi"] = sum(p.numel() for p in base.parameters())
    lengths = [
        n.meta["collective"]["length"]
        for n in transpiled["zero1"].graph_module.graph.nodes
        if n.meta.get("collective", {}).get("kind") == "reduce_scatter"
    ]
    result["comm"] = collective_ms(lengths, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "ranks": gathered}))
    # no destroy_process_group(): on torch 2.13 it can deadlock, joining a gloo thread (GIL held) that waits for
    # the GIL to free the last all-gather's tensors (seen here at W=4). The results are written, so leave.
    sys.stdout.flush()
    os._exit(0)


def collective_ms(lengths: list[int], world: int) -> dict[str, float]:
    """Median ms of ``zero1``'s bucket collectives alone, without compute: the all-reduce of the same buckets
    (what DDP and ``fused_allreduce`` send), gloo's reduce-scatters in flight together, the all-to-alls and
    local sums the CPU programs use in their place, and the all-gathers of the shards one at a time (as
    ``schedule-collectives`` runs them on the CPU)."""
    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    buckets = [torch.randn(n) for n in lengths]
    shards = [b[: n // world].clone() for b, n in zip(buckets, lengths)]
    runs = {
        "all_reduce": lambda: [c10d.wait_tensor(w) for w in [c10d.all_reduce(b, "sum", group) for b in buckets]],
        "reduce_scatter": lambda: [
            c10d.wait_tensor(w) for w in [c10d.reduce_scatter_tensor(b, "sum", world, group) for b in buckets]
        ],
        "all_to_all_sum": lambda: [
            c10d.wait_tensor(w).view(world, -1).sum(0)
            for w in [
                c10d.all_to_all_single(b, [n // world] * world, [n // world] * world, group)
                for b, n in zip(buckets, lengths)
            ]
        ],
        "all_gather": lambda: [c10d.wait_tensor(c10d.all_gather_into_tensor(s, world, group)) for s in shards],
    }
    return {k: statistics.median(v) for k, v in interleaved_ms(runs, warmup=1).items()}


def interleaved_ms(runs: dict[str, Callable[[], object]], warmup: int) -> dict[str, list[float]]:
    """ms per call of each run, one figure per round: ``ROUNDS`` rounds that take the runs in turn, each with
    ``warmup`` untimed calls, a barrier, then ``STEPS`` timed calls."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            for _ in range(warmup):
                run()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                run()
            times[name].append((time.perf_counter() - start) / STEPS * 1000)
    return times


def header(*columns: str) -> list[str]:
    """A markdown table's first two lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def comm_table(runs: list[dict]) -> str:
    """Where zero's extra time goes: its collectives alone against the all-reduce DDP sends (slowest rank)."""
    lines = header(
        "W",
        "all-reduce alone",
        "gloo reduce-scatter alone",
        "all-to-all + sum alone (what zero uses)",
        "all-gather alone",
        "A2A + AG − AR",
        "zero1 − DDP step",
    )
    for run in runs:
        ranks = run["ranks"]
        keys = ("all_reduce", "reduce_scatter", "all_to_all_sum", "all_gather")
        ar, rs, a2a, ag = (max(r["comm"][k] for r in ranks) for k in keys)
        extra = max(r["zero1"]["ms"] for r in ranks) - max(r["ddp"]["ms"] for r in ranks)
        lines.append(
            f"| {run['world']} | {ar:.1f} | {rs:.1f} | {a2a:.1f} | {ag:.1f} | {a2a + ag - ar:.1f} | {extra:.1f} |"
        )
    return "\n".join(lines)


def theory(mode: str, psi: int, world: int) -> float:
    """Bytes per rank for fp32 AdamW as the ZeRO paper counts them (Ψ parameters)."""
    per = {"ddp": 16, "fused_allreduce": 16, "zero1": 8 + 8 / world, "zero2": 4 + 12 / world, "zero3": 16 / world}
    return per[mode] * psi


def paired_ratios(ranks: list[dict], variant: str) -> list[float]:
    """The variant's time over DDP's, round by round (each the slowest rank's): the rounds ran interleaved, so
    a ratio within a round cancels the drift of a shared machine that a ratio of medians keeps."""
    world_ms = [max(times) for times in zip(*(r[variant]["rounds"] for r in ranks))]
    ddp_ms = [max(times) for times in zip(*(r["ddp"]["rounds"] for r in ranks))]
    return [v / d for v, d in zip(world_ms, ddp_ms)]


def table(runs: list[dict]) -> str:
    lines = header(
        "W",
        "variant",
        "ms/step (median, range)",
        "× DDP (median of rounds, range)",
        "parameters",
        "gradients",
        "optimizer state",
        "held",
        "theory (ZeRO paper)",
        "held / theory",
        "peak in step",
        "gathered buckets alive at once (two largest)",
    )
    for run in runs:
        world, ranks = run["world"], run["ranks"]
        for v in VARIANTS:
            worst = max(ranks, key=lambda r: r[v]["parameters"] + r[v]["gradients"] + r[v]["optimizer_state"])
            m = worst[v]
            held = m["parameters"] + m["gradients"] + m["optimizer_state"]
            ms = max(r[v]["ms"] for r in ranks)
            lo, hi = min(min(r[v]["rounds"]) for r in ranks), max(max(r[v]["rounds"]) for r in ranks)
            ratios = paired_ratios(ranks, v)
            expected = theory(VARIANTS[v][0], worst["psi"], world)
            peak = f"{m['peak'] / MIB:.2f} MiB" if m["peak"] else "–"
            buckets = (
                f"{m['gathered_peak'] / MIB:.2f} ({m['two_buckets'] / MIB:.2f}) MiB" if m.get("two_buckets") else "–"
            )
            lines.append(
                f"| {world} | {v} | {ms:.1f} ({lo:.1f}–{hi:.1f}) | {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}–{max(ratios):.2f}) | {m['parameters'] / MIB:.2f} | "
                f"{m['gradients'] / MIB:.2f} | {m['optimizer_state'] / MIB:.2f} | {held / MIB:.2f} MiB | "
                f"{expected / MIB:.2f} MiB | {held / expected:.3f} | {peak} | {buckets} |"
            )
    return "\n".join(lines)


def main() -> None:
    return_freed = RETURN_FREED in sys.argv[1:]
    runs = []
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "memory.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
            cmd += ["--master-port", "29581", __file__, str(out), *([RETURN_FREED] if return_freed else [])]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            subprocess.run(cmd, check=True, timeout=1800, env=env, cwd=ROOT)
            runs.append(json.loads(out.read_text()))
            print(f"W={world} done", flush=True)
    text = f"{table(runs)}\n\nzero1's collectives alone, ms per step (medians, no compute):\n\n{comm_table(runs)}"
    print(text)
    cpu = platform.processor() or platform.machine()
    command = f"{COMMAND} {RETURN_FREED}" if return_freed else COMMAND
    section = (
        f"{MARKERS[return_freed]}\n{text}\n\nMeasured with `{command}` on {cpu}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}: {MODEL} ({runs[0]['ranks'][0]['psi']:,} parameters), AdamW, {PER_RANK} samples "
        f"per rank, medians of {ROUNDS} rounds of {STEPS} steps, variants interleaved.\n"
    )
    doc = ROOT / "docs" / "memory.md"
    doc.write_text(with_section(doc.read_text() if doc.exists() else HEADER, return_freed, section))


def with_section(text: str, return_freed: bool, section: str) -> str:
    """``text`` with the section of this configuration replaced by ``section`` (appended when it has none)."""
    start = text.find(MARKERS[return_freed])
    if start < 0:
        return f"{text.rstrip()}\n\n{section}"
    end = text.find(MARKERS[not return_freed], start + 1)
    return text[:start] + section + ("\n" + text[end:] if end > start else "")


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(sys.argv[1], RETURN_FREED in sys.argv[2:])
    else:
        main()
