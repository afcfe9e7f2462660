"""The planner's choice of ``compile`` and ``cuda_graph`` on one GPU, against the measured rows of bench/gpu.py.

    PYTHONPATH=$PWD python3 -m bench.planner_gpu [--models gpt2,mlp] [--out docs/planner_gpu.md]

A world of one over NCCL (issue 76, item 6). For each model of bench/gpu.py (the same sizes, batch, optimizer
and bf16 autocast): ``calibrate(..., compile=True)`` measures the step eagerly and the project's program
uncaptured and compiled (``planner/programs.py``), ``plan()`` prices the four flags (default, captured, compiled,
compiled and captured) and picks one; then bench/gpu.py's variants are built afresh and measured as that bench
measures them (rounds of interleaved steps, CUDA-synchronised medians). Per flag: the calibration's time of its
program (mode ``none``: no bucket copies; compiled and captured is never measured there, but predicted), the
prediction, bench/gpu.py's measured time of ``fused_allreduce`` and their ratio; the predicted peak and the
peak of the calibration's program measured alone (bench/gpu.py's own peak column counts the other variants'
tensors, all resident at once). The pick's regret is its measured time over the fastest measured flag.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu import peak_mib, profiled, timed, variants, workload, world_of_one
from transpiler.planner import plan
from transpiler.planner.calibrate import calibrate
from transpiler.planner.programs import flags_key

VARIANT = {  # the planner's label -> bench/gpu.py's variant
    "fused_allreduce": "fused",
    "fused_allreduce, captured": "captured",
    "fused_allreduce, compiled": "compiled",
    "fused_allreduce, compiled, captured": "compiled+captured",
}
MIB = 2**20


def one_model(name: str, device: torch.device) -> tuple[list[str], dict]:
    """Calibrate, plan and measure one model; the table's rows and the figures."""
    model, batch, loss_fn, make_opt = workload(name, True)
    model = model.to(device)
    batch = tuple(t.to(device) for t in batch)
    optimizer = make_opt(model.parameters())
    memory = torch.cuda.get_device_properties(device).total_memory / MIB
    start = time.perf_counter()
    cluster = calibrate((model, optimizer, loss_fn, batch), memory, "cuda", compile=True, autocast=torch.bfloat16)
    calibration = time.perf_counter() - start
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # traced as it runs: the activations' bytes are bf16
        made = plan(model, optimizer, loss_fn, batch, cluster, objective="step_time")
    planning = time.perf_counter() - start
    print(made.table(), flush=True)
    picks = {
        steps: plan(
            model, optimizer, loss_fn, batch, cluster, objective="step_time", profile=made.profile, steps=steps
        ).best.label
        for steps in (1_000, 100_000)
    }
    del model, optimizer
    torch.cuda.empty_cache()
    steps = variants(name, device, compile_=True)
    ms = timed(steps, device)
    measured = {label: {"ms": ms[label], "peak_mib": peak_mib(step, device)} for label, step in steps.items()}
    for label, step in steps.items():
        measured[label]["kernels"], measured[label]["device_ms"] = profiled(step, device)
    ours = {label: measured[variant]["ms"] for label, variant in VARIANT.items()}
    pick = made.best.label
    rows = []
    for c in made.ranked:
        m = measured[VARIANT[c.label]]
        e = c.estimate
        alone = cluster.programs.get(flags_key(c.layout.compile, c.layout.cuda_graph))
        both = c.layout.compile and c.layout.cuda_graph  # never measured by the calibration
        calibrated = "(predicted)" if both or alone is None else f"{alone.wall * 1e3:.2f}"
        peak = "—" if both or alone is None else f"{alone.peak / MIB:,.0f}"
        rows.append(
            f"| {name} | {c.label}{' **(pick)**' if c.label == pick else ''} | {calibrated} | {e.step * 1e3:.2f} | "
            f"{m['ms']:.2f} | {e.step * 1e3 / m['ms']:.2f} | {m['ms'] / measured['DDP']['ms']:.2f} | "
            f"{e.peak / MIB:,.0f} | {peak} | {e.setup:.1f} |"
        )
    figures = {
        "model": name,
        "pick": pick,
        "regret": ours[pick] / min(ours.values()),
        "pick_vs_ddp": ours[pick] / measured["DDP"]["ms"],
        "picks_by_steps": picks,
        "calibration_s": calibration,
        "planning_s": planning,
        "programs": {flag: vars(t) for flag, t in cluster.programs.items()},
        "measured": measured,
        "predicted": {c.label: {"ms": c.estimate.step * 1e3, "peak_mib": c.estimate.peak / MIB} for c in made.ranked},
    }
    return rows, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,mlp")
    parser.add_argument("--out", default=None, help="write the markdown table there, and the figures as .json")
    args = parser.parse_args()
    device = world_of_one(29518)
    if device.type != "cuda":
        raise SystemExit("bench.planner_gpu measures compile and cuda_graph: it needs a GPU")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    lines = [
        f"Device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; bf16 autocast; world of one.",
        "",
        "| model | flags | calibration ms (mode none) | predicted ms | measured ms | predicted / measured | × DDP | "
        "predicted peak MiB | calibration peak MiB | setup s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    figures = []
    for name in args.models.split(","):
        rows, one = one_model(name, device)
        lines += rows
        figures.append(one)
        print("\n".join(rows), json.dumps({k: one[k] for k in ("pick", "regret", "pick_vs_ddp", "picks_by_steps")}))
        print(f"  calibration {one['calibration_s']:.1f} s, planning {one['planning_s']:.1f} s", flush=True)
        if args.out:  # after each model, so a run cut short keeps what it measured
            Path(args.out).write_text("\n".join(lines) + "\n")
            Path(args.out).with_suffix(".json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
