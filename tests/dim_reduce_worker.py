"""One rank of the DimReduce world (launched by tests/test_dim_reduce.py at world sizes 2 and 3).

Trains the shared least-squares problem with ``mode="dim_reduce"`` on this
rank's shard of every global batch and saves, per step, the flattened weights
and the metrics; then trains again, stopping half-way to save
``step.state_dict()`` and resuming in a fresh model, optimizer and step.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from tests import dim_reduce_problem as problem  # noqa: E402
from transpiler import DimReduce, transpile  # noqa: E402


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def new_step(basis: str):
    model = problem.model()
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=problem.LR), DimReduce(pca_path=basis), nn.MSELoss())
    return model, step


def train(basis: str, rank: int, world: int) -> dict:
    model, step = new_step(basis)
    record = {"weights": [], "metrics": [], "losses": []}
    for batch in problem.batches():
        record["losses"].append(float(step(*problem.shard(batch, rank, world))))
        record["weights"].append(flat(model))
        record["metrics"].append(dict(step.last_metrics))
    record["plan"] = [str(n.meta["collective"]) for n in step.program.graph.nodes if "collective" in n.meta]
    record["state"] = {k: v.clone() for k, v in step.extra.items()}
    return record


def resume(basis: str, rank: int, world: int) -> dict:
    batches = problem.batches()
    half = len(batches) // 2
    model, step = new_step(basis)
    for batch in batches[:half]:
        step(*problem.shard(batch, rank, world))
    saved = step.state_dict()
    model, step = new_step(basis)
    step.load_state_dict(saved)
    for batch in batches[half:]:
        step(*problem.shard(batch, rank, world))
    return {"weights": flat(model), "state": {k: v.clone() for k, v in step.extra.items()}}


def checks(rank: int, world: int, basis: str) -> dict:
    return {"train": train(basis, rank, world), "resume": resume(basis, rank, world)}


if __name__ == "__main__":
    run_rank(checks)
