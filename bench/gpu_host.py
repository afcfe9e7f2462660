"""Where the host's time goes in GPT-2's uncompiled step on one GPU, beside eager and DDP (issue 77).

    PYTHONPATH=$PWD python3 -m bench.gpu_host [--models gpt2] [--out docs/gpu_host.md]

bench/gpu.py's workloads and variants (eager, DDP, the transpiled ``fused_allreduce`` step), plus the same step
run by its program's graph module as built, without the plain runner's rewrites (casting copies and folded
constants on a GPU only, and each op's C++ entry called directly on any device: ``transpiler/runtime/plain_runner.py``):
their A/B in one run. Timed as bench/gpu.py times (the
variants take turns, 5 rounds (``--rounds``) of 5 steps after 3 warm-ups, CUDA-synchronised), each ratio the
median over rounds of the variant's time over DDP's in the same round; then each variant is
profiled over 3 steps with ``torch.profiler``: kernels, device time, the aten ops it dispatched from the host,
its calls into the CUDA runtime that wait for the device (synchronisations, copies to the host), and the host ops
that took the most of its own time. On a machine without CUDA it is a dry run at small sizes, over gloo.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu import ROUNDS, STEPS, finish, session, timed_rounds, variants

PROFILED = 3
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def unfolded(step: Callable) -> Callable:
    """The same built step run by its programs' graph modules as built (no plain runner)."""
    built = step.transpiled._state.built
    runners = dict(built.runners)

    def run() -> None:
        built.runners = {v: p.graph_module for v, p in built.programs.items()}
        try:
            step()
        finally:
            built.runners = runners

    return run


def profile(step: Callable, cuda: bool, trace: Path | None = None) -> dict:
    """Per step: kernels, device ms, host aten ops, waiting runtime calls, and the top host ops by self time;
    ``trace``: the profile written there too (Chrome's trace format, gzipped)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED):
            step()
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    aten = [e for e in host if e.name.startswith("aten::") and not _nested_in_aten(e)]
    waits = Counter(e.name for e in host if e.name in WAITS)
    self_ms = Counter({a.key: a.self_cpu_time_total / 1e3 / PROFILED for a in prof.key_averages()})
    return {
        "kernels": len(kernels) / PROFILED,
        "device_ms": sum(e.device_time for e in kernels) / 1e3 / PROFILED,
        "aten_ops": len(aten) / PROFILED,
        "waits": {k: v / PROFILED for k, v in waits.items()},
        "top": self_ms.most_common(12),
    }


def _ratio(mine: list[float], peer: list[float]) -> str:
    ratios = [a / b for a, b in zip(mine, peer)]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}, {max(ratios):.2f})"


def _nested_in_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds (default {ROUNDS})")
    parser.add_argument("--out", default=None, help="write the Markdown report there too")
    parser.add_argument("--traces", default=None, help="a folder: each variant's profile as <model>_<variant>.json.gz")
    args = parser.parse_args()
    device, header = session(29519)
    cuda = device.type == "cuda"
    lines = [header, ""]
    for model_name in args.models.split(","):
        steps = variants(model_name, device, compile_=False)
        steps.pop("captured", None)
        steps["fused, unfolded"] = unfolded(steps["fused"])
        rounds = timed_rounds(steps, device, args.rounds)
        ms = {label: statistics.median(t) for label, t in rounds.items()}
        lines += [
            f"**{model_name}**, {args.rounds} rounds of {STEPS} steps; × DDP: the median over rounds of the "
            "variant's time over DDP's in the same round (lowest, highest)",
            "",
            "| variant | ms/step | × DDP | kernels/step | device ms/step | host aten ops/step | waits/step |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        tops = []
        for label, step in steps.items():
            traces = Path(args.traces) if args.traces else None
            p = profile(step, cuda, traces / f"{model_name}_{label.replace(', ', '_')}.json.gz" if traces else None)
            waits = ", ".join(f"{k} {v:g}" for k, v in sorted(p["waits"].items())) or "none"
            lines.append(
                f"| {label} | {ms[label]:.2f} | {_ratio(rounds[label], rounds['DDP'])} | {p['kernels']:.0f} | "
                f"{p['device_ms']:.2f} | {p['aten_ops']:.0f} | {waits} |"
            )
            tops.append(f"- {label}: " + "; ".join(f"{k} {v:.2f}" for k, v in p["top"]))
            print(lines[-1], flush=True)
        lines += ["", "Host self time per step (ms), the largest:", "", *tops, "", "Each round's ms per step:", ""]
        lines += [f"- {label}: " + ", ".join(f"{t:.2f}" for t in times) for label, times in rounds.items()] + [""]
    finish("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
