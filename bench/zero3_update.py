"""ZeRO-3's update on flat shards against the same update as multi-tensor ops over the slices, at W=2.

``zero3`` binds each rank's parameter slices of a gather unit to views of one flat shard and updates each unit
once (``flatten-update``), as ``zero2`` does; without ``flatten-update`` the update is one multi-tensor op per term
over every slice (``foreach-update``). This runs both, with the default units (``cost``: one unit on the CPU) and
with a unit per layer (``layer``: about 50), and ``zero2`` beside them, on the narrow GPT and CNN of
``bench/fsdp.py``: AdamW, 4 samples per rank, gloo, one thread per rank. It reports the step time (median of
interleaved rounds, the slower rank) and the work and view ops of one step on rank 0.

``python bench/zero3_update.py`` writes the table into ``docs/strategies/zero.md``.
"""

from __future__ import annotations

import copy
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.host_ops import ROUNDS, STEPS, interleaved_ms
from bench.models import NarrowGPT, NarrowResNet, narrow_batch
from bench.op_count import count_ops
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import transpile

DOC = Path(__file__).resolve().parent.parent / "docs" / "strategies" / "zero.md"
BEGIN, END = "<!-- zero3-update -->", "<!-- /zero3-update -->"
ZERO3 = (
    "broadcast-params,scale-loss-grad,shard-optimizer{{bucket-cap-mb={units},keep-gradient-buckets=false,"
    "module-buckets=true}},shard-params,{flat}foreach-update,schedule-collectives,reinplace-optimizer"
)
VARIANTS = {  # label -> mode or pipeline spec
    "zero3 (flat)": ZERO3.format(units="cost", flat="flatten-update,"),
    "zero3, multi-tensor": ZERO3.format(units="cost", flat=""),
    "zero3, layer units (flat)": ZERO3.format(units="layer", flat="flatten-update,"),
    "zero3, layer units, multi-tensor": ZERO3.format(units="layer", flat=""),
    "zero2": "zero2",
}
MODELS = {"narrow GPT (12 blocks, d=16)": (NarrowGPT, "gpt"), "narrow CNN (16 residual blocks)": (NarrowResNet, "cnn")}


def worker(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    result: dict[str, dict] = {}
    for title, (make, kind) in MODELS.items():
        torch.manual_seed(0)
        base = make()
        batch = narrow_batch(kind, 4, torch.Generator().manual_seed(rank))
        runs, counts = {}, {}
        for label, spec in VARIANTS.items():
            model = copy.deepcopy(base)
            step = transpile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), spec, nn.CrossEntropyLoss(), batch)
            step(*batch)
            runs[label] = lambda step=step, batch=batch: step(*batch)
            counter = count_ops(runs[label])
            counts[label] = {"work": counter.work, "views": counter.views, "units": len(step.program.param_buckets)}
        times = interleaved_ms(runs)
        result[title] = {"counts": counts, "ms": {label: statistics.median(t) for label, t in times.items()}}
    finish_rank(out, result)


def render(ranks: list[dict]) -> str:
    lines = [
        f"`python bench/zero3_update.py` (W=2, gloo, one thread per rank, AdamW, torch {torch.__version__}; step ms: "
        f"median over {ROUNDS} rounds of {STEPS} steps, the slower rank; ops: one step, rank 0):",
        "",
    ]
    for title in ranks[0]:
        lines += [f"**{title}**", "", "| variant | units | step ms | work ops | view ops |"]
        lines.append("|---|---:|---:|---:|---:|")
        for label, count in ranks[0][title]["counts"].items():
            ms = max(r[title]["ms"][label] for r in ranks)
            lines.append(f"| {label} | {count['units'] or '–'} | {ms:.1f} | {count['work']} | {count['views']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    body = render(two_rank_results(__file__, lambda out, _: [out], port=29593))
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    entry(worker, main)
