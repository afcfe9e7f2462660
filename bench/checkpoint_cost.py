"""What a checkpoint costs against a plain step: seconds to save and to resume, and bytes on disk, for the digits
example's MLP and a 10M-parameter GPT, at W=2 over gloo with AdamW (docs/fault_tolerance.md).

    python -m bench.checkpoint_cost

Each rank times steps, then ``Checkpointer.save()`` (every rank writes its part with torch.distributed.checkpoint,
rank 0 the data position, one rename), then ``resume()`` into a fresh step. Medians over the repeats, the
slower rank.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.models import NarrowGPT
from bench.two_ranks import two_rank_results, write_section
from transpiler import Checkpointer, DataPosition, transpile

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "fault_tolerance.md"
BEGIN, END = "<!-- checkpoint_cost:begin -->", "<!-- checkpoint_cost:end -->"
STEPS, SAVES = 20, 5
MODES = ("fused_allreduce", "zero2")


def digits_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def gpt_10m() -> nn.Module:
    return NarrowGPT(blocks=12, dim=256, heads=4, vocab=512, seq=32)


def batch(name: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "digits MLP":
        return torch.rand(64, 64, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    tokens = torch.randint(0, 512, (8, 33), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()


MODELS = {"digits MLP": digits_mlp, "GPT, 10M parameters": gpt_10m}  # the GPT is bench/models.py's, widened


def build(name: str, mode: str):
    torch.manual_seed(0)
    model = MODELS[name]()
    step = transpile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mode, loss_fn=nn.CrossEntropyLoss())
    return model, step


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(name: str, mode: str, root: Path) -> dict:
    model, step = build(name, mode)
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = batch(name, gen)
    position = DataPosition(10_000, 64)
    checkpointer = Checkpointer(
        step, root / f"{name}-{mode}".replace(" ", "_").replace(",", ""), every=1, keep=1, position=position
    )
    for _ in range(3):
        step(*data)
    step_s = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step(*data)
        step_s.append(time.perf_counter() - start)
    save_s, resume_s = [], []
    for _ in range(SAVES):
        checkpointer.steps += 1
        start = time.perf_counter()
        written = checkpointer.save()
        save_s.append(time.perf_counter() - start)
    for _ in range(SAVES):
        _, fresh = build(name, mode)
        start = time.perf_counter()
        Checkpointer(fresh, checkpointer.directory, every=1, position=DataPosition(10_000, 64)).resume()
        resume_s.append(time.perf_counter() - start)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms": statistics.median(step_s) * 1e3,
        "save_ms": statistics.median(save_s) * 1e3,
        "resume_ms": statistics.median(resume_s) * 1e3,
        "bytes": folder_bytes(written),
    }


def rank_main(out: str, root: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    result = {f"{name}|{mode}": measure(name, mode, Path(root)) for name in MODELS for mode in MODES}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group(): torch 2.13 can deadlock there (bench/memory.py)


def table(ranks: list[dict]) -> str:
    lines = [
        "| model | parameters | mode | step ms | save ms | save / step | resume ms | bytes on disk |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for key in ranks[0]:
        name, mode = key.split("|")
        worst = {k: max(r[key][k] for r in ranks) for k in ("step_ms", "save_ms", "resume_ms")}
        first = ranks[0][key]
        lines.append(
            f"| {name} | {first['params']:,} | {mode} | {worst['step_ms']:.1f} | {worst['save_ms']:.0f} | "
            f"{worst['save_ms'] / worst['step_ms']:.1f}× | {worst['resume_ms']:.0f} | "
            f"{first['bytes'] / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, tmp: [out, tmp], port=29589)
    cpu = platform.processor() or platform.machine()
    body = (
        f"`python -m bench.checkpoint_cost` (W=2 over gloo, one thread per rank, AdamW, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, {cpu}, local disk; medians of {STEPS} steps and {SAVES} saves and resumes, the "
        "slower rank):\n\n" + table(ranks) + "\n"
    )
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(sys.argv[1], sys.argv[2])
    else:
        main()
