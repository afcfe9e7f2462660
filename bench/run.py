"""Run every benchmark on this machine and write docs/benchmarks.md.

    python -m bench.run            # 2 processes over gloo, then the pass-time sweep

Nothing here is a test: it measures and reports, including where a goal is missed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench import pass_time
from bench.step_time import ROUNDS, STEPS, WARMUP

ROOT = Path(__file__).resolve().parent.parent

COMMAND = "python -m bench.run"
COUNTERPARTS = {  # a transpiled variant and the DDP configuration that does the same thing
    "fused accumulate_steps=4": "ddp no_sync k=4",
    "fused compress=fp16": "ddp fp16 hook",
}


def step_times() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "29571",
            str(ROOT / "bench" / "step_time.py"),
            str(out),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        subprocess.run(cmd, check=True, timeout=1800, env=env, cwd=ROOT)
        return json.loads(out.read_text())


def render(steps: dict, passes: list[dict]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "See also [serial_limit.md](serial_limit.md) (`python -m bench.limit`): the fused step against DDP and the "
        "serial limit on four workloads, where its time goes, and `compile=True` against "
        '`torch.compile(DDP(model))`, persistent bucket buffers and `bucket_cap_mb="auto"`; '
        "[performance.md](performance.md) reads it against issue 9's goals, met and missed.",
        "",
        f"Produced by `{COMMAND}` on {platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}, "
        "gloo over loopback, 2 processes with one thread each, SGD with momentum. Step times are medians over "
        f"{ROUNDS} rounds that interleave the variants (each round: {WARMUP} warm-up steps, then {STEPS} timed steps); "
        "the ratio is to "
        "DDP in the same run (below 1 is faster). Two single-threaded ranks share two cores, so rounds vary by "
        "about ±10%: read ratios within 0.9–1.1 as parity.",
        "",
        "## Step time against DDP",
        "",
        "| model | params | variant | median step (ms) | rounds min–max (ms) | ratio to DDP | ratio to its DDP "
        "counterpart | comm. ops / step | bytes sent / step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, data in steps.items():
        ddp = data["variants"]["ddp"]["median_s"]
        for variant, v in data["variants"].items():
            twin = COUNTERPARTS.get(variant)
            versus = f"{v['median_s'] / data['variants'][twin]['median_s']:.3f} ({twin})" if twin else "–"
            lines.append(
                f"| {name} | {data['params'] / 1e6:.2f}M | {variant} | {v['median_s'] * 1e3:.2f} | "
                f"{min(v['rounds_s']) * 1e3:.1f}–{max(v['rounds_s']) * 1e3:.1f} | "
                f"{v['median_s'] / ddp:.3f} | {versus} | {v['ops_per_step']:.2f} | "
                f"{v['bytes_per_step'] / 2**20:.3f} MiB |"
            )
    lines += [
        "",
        "Communication operations and bytes per step are averaged over the steps each variant ran (LocalSGD's local",
        "steps send nothing). For DDP: its bucket count after the first iteration (as its logging data reports it)",
        "and the gradient bytes. For the transpiled modes they are read off the rank's graph: all-reduce payloads",
        "(what this rank contributes to each), broadcast-free steady state, and for AdaSum the bytes each",
        "point-to-point exchange sends plus its small all-reduces of dot products and norms.",
        "A ring all-reduce moves about 2(W-1)/W times its payload over the wire.",
        "",
        "The Boost/SINGA rows (issue 7) use the same step and data. Accumulation rows time one *call* (a",
        "micro-batch): 3 of 4 calls communicate nothing. Compression rows send half the bytes. Sparsification sends",
        "indices (8 bytes) and values (4 bytes) for its share of each bucket via all-gather, and then pays for `topk`",
        "and a dense rebuild. Freeze (4 groups, continuous schedule, freeze_p=0.5) skips the early groups' backward",
        "and communication on 3 of 6 steps. Partial sync averages a quarter of the parameters per step. The",
        "all-gather mode gathers every rank's gradients and runs the optimizer twice. Loss scaling adds a 4-byte",
        "all-reduce and `where` selections. Clipping adds a pass over the gradients.",
        "",
        "## Pipeline time against graph size",
        "",
        "Deep narrow MLPs (Linear(8, 8) + ReLU layers) with SGD+momentum, mode `fused_allreduce`, world size 2, ",
        "verifiers on. Each pass's time includes the verifiers and recompile that follow it.",
        "",
        "| layers | nodes traced | nodes after | trace (s) | pipeline (s) | " + " | ".join(passes[0]["passes"]) + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(passes[0]["passes"]),
    ]
    for row in passes:
        per_pass = " | ".join(f"{s:.2f}" for s in row["passes"].values())
        lines.append(
            f"| {row['layers']} | {row['nodes']} | {row['nodes_after']} | {row['trace_s']:.1f} | "
            f"{row['pipeline_s']:.2f} | {per_pass} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    print("step time: DDP, allreduce, fused_allreduce on 2 processes ...", flush=True)
    steps = step_times()
    passes = pass_time.run()
    text = render(steps, passes)
    target = ROOT / "docs" / "benchmarks.md"
    target.write_text(text)
    print(text)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
