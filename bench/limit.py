"""How close is the fused step to the physical limit? DDP, fused_allreduce and the serial limit in one run.

    python -m bench.limit           # 2 processes over gloo; writes docs/serial_limit.md

The serial limit of a workload is this rank's step with no communication at all (mode ``none``: the
same traced forward, backward and update) plus one flat all-reduce of all its gradient bytes, each
timed in the same run. A data-parallel step that overlapped nothing would take about that long; one
that overlapped communication with the backward perfectly could take less. Variants are interleaved
round by round. A profile of the fused step splits each step into compute, copies into and out of
buckets (``cat``, ``split``, ``copy_``) and time blocked in ``wait_tensor``.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.models import TinyTransformer
from bench.two_ranks import two_rank_results
from transpiler import Execution, mode_config, transpile

ROOT = Path(__file__).resolve().parent.parent

COMMAND = "python -m bench.limit"
WARMUP, STEPS, ROUNDS = 3, 10, 6
PROFILED_STEPS = 10
PROFILED = (
    "fused_allreduce",
    "fused, no bucket views",
    "fused, one bucket",
)  # compiled kernels are not aten ops: not split here
COPY_OPS = ("aten::cat", "aten::split_with_sizes", "aten::copy_", "aten::_to_copy")
WAIT_OPS = ("_c10d_functional::wait_tensor",)


def mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def classify(n: int, d_in: int, gen: torch.Generator) -> tuple:
    return torch.randn(n, d_in, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def tokens(n: int, gen: torch.Generator) -> tuple:
    return torch.randint(0, 2000, (n, 32), generator=gen), torch.randint(0, 10, (n,), generator=gen)


# name -> (model builder, per-rank batch builder)
WORKLOADS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple]]] = {
    "MLP 1024-2048-1024-10, batch 64": (lambda: mlp([1024, 2048, 1024, 10]), lambda g: classify(64, 1024, g)),
    "MLP 1024-2048-1024-10, batch 8": (lambda: mlp([1024, 2048, 1024, 10]), lambda g: classify(8, 1024, g)),
    "transformer 8 blocks d=128, 16x32 tokens": (lambda: TinyTransformer(layers=8), lambda g: tokens(16, g)),
    "MLP 80 layers of 128 (160 tensors), batch 64": (lambda: mlp([128] * 81), lambda g: classify(64, 128, g)),
}
FUSED = {
    "fused_allreduce": {},
    "fused, one bucket": {"bucket_cap_mb": 1000.0, "first_bucket_mb": 1000.0},
    "fused, compile=True": {},  # and Execution(compile=True): COMPILED
    "fused, no bucket views": {"gradient_as_bucket_view": False},
    "fused, auto caps": {"bucket_cap_mb": "auto"},
}

OTHER_MODES = {"local step": ("none", {}), "adasum": ("adasum", {})}
COMPILED = ("fused, compile=True",)


class Step:
    """One variant's step on this rank: DDP, a transpiled mode, or the flat all-reduce alone."""

    def __init__(self, label: str, base: nn.Module, batch: tuple):
        self.label, self.batch = label, batch
        model = copy.deepcopy(base)
        self.loss_fn = nn.CrossEntropyLoss()
        if label in ("ddp", "ddp, torch.compile"):
            self.ddp = DDP(model)
            self.forward = torch.compile(self.ddp) if label != "ddp" else self.ddp
            self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01, momentum=0.9)
            self.run = self._ddp
        elif label == "flat all-reduce":
            self.flat = torch.zeros(sum(p.numel() for p in model.parameters()))
            self.run = lambda: dist.all_reduce(self.flat)
        else:
            mode, options = OTHER_MODES.get(label) or ("fused_allreduce", FUSED[label])
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            execution = Execution(compile=label in COMPILED)
            config = mode_config(mode, **options)
            self.step = transpile(model, opt, config, self.loss_fn, batch, execution=execution)
            self.run = lambda: self.step(*batch)

    def _ddp(self) -> None:
        self.opt.zero_grad()
        self.loss_fn(self.forward(self.batch[0]), self.batch[1]).backward()
        self.opt.step()


def interleaved(steps: dict[str, Step]) -> dict[str, list[float]]:
    """Seconds per step of each variant, one entry per round; the variants take turns within a round."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(ROUNDS):
        for label, step in steps.items():
            for _ in range(WARMUP):
                step.run()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                step.run()
            dist.barrier()
            times[label].append((time.perf_counter() - start) / STEPS)
    return times


def profile(step: Step) -> dict[str, float]:
    """Seconds per step in compute, bucket copies and waiting, from the profiler's self times."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            step.run()
    parts = {"compute": 0.0, "copies": 0.0, "waiting": 0.0}
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "_c10d_functional::")):
            continue
        part = "copies" if event.key in COPY_OPS else "waiting" if event.key in WAIT_OPS else "compute"
        parts[part] += event.self_cpu_time_total / 1e6 / PROFILED_STEPS
    return parts


def worker(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {}
    for name, (build, make_batch) in WORKLOADS.items():
        torch.manual_seed(0)
        base = build()
        batch = make_batch(torch.Generator().manual_seed(rank))
        labels = ["ddp", "ddp, torch.compile", *FUSED, "adasum", "local step", "flat all-reduce"]
        steps = {label: Step(label, base, batch) for label in labels}
        compile_s = {}
        for label in ("ddp, torch.compile", "fused, compile=True"):  # the first call compiles
            start = time.perf_counter()
            steps[label].run()
            compile_s[label] = time.perf_counter() - start
        times = interleaved(steps)
        results[name] = {
            "params": sum(p.numel() for p in base.parameters()),
            "tensors": len(list(base.parameters())),
            "median_s": {label: statistics.median(t) for label, t in times.items()},
            "rounds_s": times,
            "compile_s": compile_s,
            "buckets": {label: _buckets(steps[label]) for label in FUSED},
            "auto": steps["fused, auto caps"].step.program.decisions.get("fuse-allreduce", ""),
            "profile": {label: profile(steps[label]) for label in PROFILED},
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def _buckets(step: Step) -> int:
    return sum(1 for n in step.step.program.graph.nodes if "collective" in n.meta)


def render(results: dict) -> str:
    lines = [
        "# Fused step against DDP and the serial limit",
        "",
        f"Produced by `{COMMAND}` on {platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}, "
        "gloo over loopback, 2 processes with one thread each, SGD with momentum. Medians over "
        f"{ROUNDS} interleaved rounds ({WARMUP} warm-up steps, {STEPS} timed). The serial limit is the local step "
        "(mode `none`, no communication) plus one flat all-reduce of all gradient bytes, both measured in the "
        "same run. What the numbers mean, and where goals are missed: [performance.md](performance.md).",
        "",
        "| workload | params (tensors) | DDP (ms) | fused (ms) | fused, one bucket (ms) | local step (ms) | "
        "flat all-reduce (ms) | serial limit (ms) | fused / DDP | fused / limit | one bucket / limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        m = {k: v * 1e3 for k, v in r["median_s"].items()}
        limit = m["local step"] + m["flat all-reduce"]
        lines.append(
            f"| {name} | {r['params'] / 1e6:.2f}M ({r['tensors']}) | {m['ddp']:.1f} | {m['fused_allreduce']:.1f} | "
            f"{m['fused, one bucket']:.1f} | {m['local step']:.1f} | {m['flat all-reduce']:.1f} | {limit:.1f} | "
            f"{m['fused_allreduce'] / m['ddp']:.2f} | {m['fused_allreduce'] / limit:.2f} | "
            f"{m['fused, one bucket'] / limit:.2f} |"
        )
    lines += [
        "",
        "Persistent bucket buffers (`gradient_as_bucket_view`, the default: gradients produced or copied into "
        'buffers allocated once) against a fresh `cat` per bucket each step, and `bucket_cap_mb="auto"` '
        "against the default caps, same run:",
        "",
        "| workload | DDP (ms) | fused (ms) | no bucket views (ms) | views / no views | auto caps (ms) | "
        "auto / DDP | buckets default / auto |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        m = {k: v * 1e3 for k, v in r["median_s"].items()}
        fused, plain, auto = m["fused_allreduce"], m["fused, no bucket views"], m["fused, auto caps"]
        lines.append(
            f"| {name} | {m['ddp']:.1f} | {fused:.1f} | {plain:.1f} | {fused / plain:.2f} | {auto:.1f} | "
            f"{auto / m['ddp']:.2f} | {r['buckets']['fused_allreduce']} / {r['buckets']['fused, auto caps']} |"
        )
    lines += ["", "What `auto` chose on each workload (rank 0's words; every rank chose the same):", ""]
    lines += [f"- {name}: {r['auto']}" for name, r in results.items()]
    lines += [
        "",
        "AdaSum (`AdaSum()`, recursive halving with point-to-point exchanges, float64 statistics) in the same run:",
        "",
        "| workload | DDP (ms) | adasum (ms) | adasum / DDP |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        m = {k: v * 1e3 for k, v in r["median_s"].items()}
        lines.append(f"| {name} | {m['ddp']:.1f} | {m['adasum']:.1f} | {m['adasum'] / m['ddp']:.2f} |")
    lines += [
        "",
        "Compiled (`transpile(..., execution=Execution(compile=True))` against `torch.compile(DDP(model))`, same "
        "run; compile time is the "
        "first call, on each rank while the other compiles too):",
        "",
        "| workload | DDP (ms) | DDP + torch.compile (ms) | fused, compile=True (ms) | compiled fused / DDP | "
        "compiled fused / compiled DDP | compile s (DDP / fused) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        m = {k: v * 1e3 for k, v in r["median_s"].items()}
        ddp_c, ours_c = m["ddp, torch.compile"], m["fused, compile=True"]
        seconds = r["compile_s"]
        lines.append(
            f"| {name} | {m['ddp']:.1f} | {ddp_c:.1f} | {ours_c:.1f} | {ours_c / m['ddp']:.2f} | "
            f"{ours_c / ddp_c:.2f} | {seconds['ddp, torch.compile']:.0f} / {seconds['fused, compile=True']:.0f} |"
        )
    lines += [
        "",
        f"Where the fused step's time goes (profiler self time per step over {PROFILED_STEPS} steps, ms; the "
        "profiler adds overhead, so the parts sum to more than the timed step):",
        "",
        "| workload | variant | buckets | compute | bucket copies (cat, split, copy) | blocked in wait_tensor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        for label, parts in r["profile"].items():
            lines.append(
                f"| {name} | {label} | {r['buckets'][label]} | {parts['compute'] * 1e3:.1f} | "
                f"{parts['copies'] * 1e3:.1f} | {parts['waiting'] * 1e3:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    results = two_rank_results(__file__, lambda out, _: ["--worker", out], port=29573)
    (ROOT / "docs" / "serial_limit.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
