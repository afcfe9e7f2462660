"""The memory budget in a world of 2 ranks (tests/test_recompute.py): ``fused_allreduce`` and ``zero3`` with and
without a budget (0.6 and the least), and the other families' modes (LocalSGD, DiLoCo, AdaSum) without one
and at the least: 10 AdamW steps each from the same weights, the weights and losses of every rank returned."""

from __future__ import annotations

import torch
from torch import nn

from transpiler import AdaSum, DataParallel, DiLoCo, Execution, LocalSGD, TraceCache, ZeRO, transpile

from .recompute_models import MODELS

STEPS = 10


def trained(config, budget: float | None, rank: int, traces: TraceCache) -> dict:
    make, batch_of = MODELS["gpt"]
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [batch_of(4, 100 * step + rank) for step in range(STEPS)]
    step = transpile(
        model,
        optimizer,
        config,
        nn.CrossEntropyLoss(),
        batches[0],
        execution=Execution(memory_budget=budget),
        trace=traces,  # one trace for every mode and budget: the budget and the passes work on copies of it
    )
    torch.manual_seed(1 + rank)  # the dropout masks: the same draws with and without a budget
    losses = [step(*batch).detach().clone() for batch in batches]
    with step.gathered(writeback=False) as whole:
        weights = [p.detach().clone() for p in whole.parameters()]
    return {"losses": losses, "weights": weights, "decision": step.program.decisions.get("recompute", "")}


MODES = {
    "fused_allreduce": (DataParallel(), (None, 0.6, 0.0)),
    "zero3": (ZeRO(stage=3), (None, 0.6, 0.0)),
    "local_sgd": (LocalSGD(k_steps=3), (None, 0.0)),
    "diloco": (DiLoCo(sync_every=3), (None, 0.0)),
    "adasum": (AdaSum(), (None, 0.0)),
}


def budgets(rank: int, world: int) -> dict:
    traces = TraceCache()
    return {f"{name},{b}": trained(config, b, rank, traces) for name, (config, bs) in MODES.items() for b in bs}
