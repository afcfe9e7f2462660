"""What ``keep_freed_memory`` costs and saves on the CPU: page faults, step time and the process's peak RSS.

    python -m bench.host_memory      # one torchrun world of 2 per mode and setting, about 3 minutes

Each world runs one mode on the 5M-parameter MLP of bench/models.py with AdamW, ``WARMUP`` untimed steps and
``STEPS`` timed ones, with ``keep_freed_memory`` True (the default: glibc keeps what a step frees,
``transpiler/runtime/host_memory.py``) or False (glibc as it comes). Rank 0 reports the minor page faults per
timed step (the pages the allocator took back from the kernel), the median step time, and the process's peak
resident memory (``ru_maxrss``), which is what keeping freed memory could grow. A world per row, so that no
row inherits another's heap; times of different worlds compare less well than bench/memory.py's interleaved
rounds. Nothing here is a test.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.models import start_rank
from transpiler import Execution, transpile

ROOT = Path(__file__).resolve().parent.parent

MODEL, PER_RANK, WARMUP, STEPS = "mlp_5m", 32, 5, 30
MODES = ("fused_allreduce", "zero1", "zero2", "zero3")


def rank_main(mode: str, keep: bool, out: str) -> None:
    rank, model, batch = start_rank(MODEL, PER_RANK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = transpile(model, optimizer, mode, torch.nn.CrossEntropyLoss(), execution=Execution(keep_freed_memory=keep))
    for _ in range(WARMUP):
        step(*batch)
    dist.barrier()
    faults, times = [], []
    for _ in range(STEPS):
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step(*batch)
        times.append((time.perf_counter() - start) * 1000)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    if rank == 0:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        said = step.program.decisions.get("keep-freed-memory", "glibc as it comes")
        result = {"faults": statistics.mean(faults), "ms": statistics.median(times), "rss": peak_mib, "said": said}
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # no destroy_process_group(): torch 2.13 can deadlock there (bench/memory.py)


def main() -> None:
    rows = ["| mode | keep_freed_memory | minor page faults per step | ms/step (median) | peak RSS, rank 0 |"]
    rows.append("|---|---|---|---|---|")
    said = ""
    for mode in MODES:
        for keep in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
                cmd += ["--master-port", "29587", __file__, mode, str(keep), str(out)]
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
                subprocess.run(cmd, check=True, timeout=600, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
                r = json.loads(out.read_text())
            said = r["said"] if keep else said
            rows.append(f"| {mode} | {keep} | {r['faults']:,.0f} | {r['ms']:.1f} | {r['rss']:.0f} MiB |")
            print(rows[-1], flush=True)
    cpu = platform.processor() or platform.machine()
    print(
        f"\n{chr(10).join(rows)}\n\nMeasured with `python -m bench.host_memory` on {cpu}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}: {MODEL}, AdamW, {PER_RANK} samples per rank, W=2 over gloo, {STEPS} timed "
        f"steps after {WARMUP}. The last mode's decision: {said}"
    )


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(sys.argv[1], sys.argv[2] == "True", sys.argv[3])
    else:
        main()
