"""Ops one step dispatches when the update cannot be flat: a bfloat16 GPT with AdamW, one process.

    python -m bench.foreach_ops     # seconds; prints a Markdown table (docs/performance.md quotes it)

bfloat16 ``add(..., alpha=)`` rounds differently on a flat buffer (docs/bitwise.md), so ``flatten-update``
leaves these parameters per parameter and ``foreach-update`` runs their update as ``_foreach_*`` ops. The
table counts the aten ops of one step after warm-up (``bench/op_count.py``) for eager AdamW with
``foreach=True`` and with the for-loop, and for ``fused_allreduce`` (world of one) with and without
``foreach-update``, on the 4-block and 12-block narrow GPT: the multi-tensor update does not grow with the
number of parameters. Nothing here is a test, and no time is measured.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from bench.models import NarrowGPT, narrow_batch
from bench.op_count import count_ops
from passes.foreach_update import ForeachUpdate
from transpiler import StaticWorld, transpile

ROOT = Path(__file__).resolve().parent.parent

LOSS = nn.CrossEntropyLoss()


def eager(model: nn.Module, foreach: bool, batch: tuple) -> object:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        LOSS(model(batch[0]), batch[1]).backward()
        optimizer.step()

    return step


def transpiled(model: nn.Module, foreach: bool, batch: tuple) -> object:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    run = ForeachUpdate.run
    if not foreach:
        ForeachUpdate.run = lambda self, program: False
    try:
        step = transpile(model, optimizer, "fused_allreduce", LOSS, batch, mesh=StaticWorld(size=1, rank=0))
    finally:
        ForeachUpdate.run = run
    return lambda: step(*batch)


VARIANTS = {
    "eager AdamW, foreach": lambda m, b: eager(m, True, b),
    "eager AdamW, for-loop": lambda m, b: eager(m, False, b),
    "fused_allreduce, per parameter": lambda m, b: transpiled(m, False, b),
    "fused_allreduce, foreach-update": lambda m, b: transpiled(m, True, b),
}


def main() -> None:
    rows = {label: [] for label in VARIANTS}
    for blocks in (4, 12):
        torch.manual_seed(0)
        base = NarrowGPT(blocks=blocks).bfloat16()
        batch = narrow_batch("gpt", 4, torch.Generator().manual_seed(0))
        for label, make in VARIANTS.items():
            step = make(copy.deepcopy(base), batch)
            for _ in range(3):
                step()
            counter = count_ops(step)
            rows[label].append((counter.work, counter.views))
    print(f"bfloat16 narrow GPT, AdamW, batch 4, torch {torch.__version__} (`python -m bench.foreach_ops`):\n")
    print("| variant | work ops, 4 blocks | views | work ops, 12 blocks | views |")
    print("|---|---:|---:|---:|---:|")
    for label, counts in rows.items():
        print(f"| {label} | " + " | ".join(f"{w} | {v}" for w, v in counts) + " |")


if __name__ == "__main__":
    main()
