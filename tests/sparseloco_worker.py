"""One rank of the SparseLoCo runs (tests/test_sparseloco.py), every rank on its own data, in the worlds of 2 and 4
ranks that tests/test_diloco.py also uses.

1. ``reference``: ``sparseloco`` (H=3, AdamW inside; tiles of at most 8 × 8, top-12 of 64 scaled to each tile,
   4 bins, β=0.9, α=0.8) for 4 outer rounds, against tplr's DiLoCo loop and SparseLoCo optimizer that this rank
   runs eagerly for *every* replica (``AuthorsSparseLoCo``, the exchange of ``bench/authors_sparse.py``, written
   from the authors' code, not imported from the project). ``replica_size=2`` at W=4: two replicas of two
   ranks, data parallel or ZeRO-1 inside.
2. ``identity``: every entry sent in float32, β = 0, α = 1 against ``diloco`` with outer ``SGD(lr=1)``.
3. ``resume``: ``step.state_dict()`` mid-round (the error buffers non-zero) continues as the run that never stopped.
4. ``wire``: the bytes of the all-gather's message, and the verifier refusing an error buffer that leaves the rank.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import authors_sparse  # noqa: E402
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP  # noqa: E402
from tests.diloco_worker import (  # noqa: E402
    LOSS,
    H,
    PaperDiLoCo,
    data,
    each_run,
    inner_optimizer,
    params_of,
    side_by_side,
)
from transpiler import DiLoCo, mode_config, transpile  # noqa: E402

ROUNDS = 4
# tiles of at most 8 × 8: 8 × 5, 8 × 8 and 5 × 8 for the MLP's matrices, 8 and 5 for its biases; k = 12 of 64
SPARSE = {"chunk_size": 8, "topk": 12, "quantization_bins": 4, "error_decay": 0.9, "outer_lr": 0.8}


class AuthorsSparseLoCo(PaperDiLoCo):
    """tplr's DiLoCo loop (``Diloco.outer_step``) driving its ``SparseLoCo`` optimizer, eager, for all replicas:
    Δ = θ_saved − θ; ``e ← β·e`` (unless β = 1), ``e ← e + lr·Δ``; the exchange of ``bench/authors_sparse.py``;
    θ_global takes SGD(lr) on the aggregate."""

    def __init__(self, model, replicas: int, options: dict):
        super().__init__(model, replicas, outer_lr=options["outer_lr"], momentum=0.0)
        self.options = options
        self.errors = [[torch.zeros_like(t) for t in self.theta] for _ in range(replicas)]

    def sync(self) -> None:
        o = self.options
        for i, theta in enumerate(self.theta):
            buffers = []
            for r, model in enumerate(self.replicas):
                e = self.errors[r][i]
                if o["error_decay"] != 1.0:
                    e = e * o["error_decay"]
                buffers.append(e.add(theta.detach() - list(model.parameters())[i].detach(), alpha=o["outer_lr"]))
            bins, sigmas = o.get("quantization_bins", 4), o.get("quantization_range", 6)
            kept, theta.grad = authors_sparse.exchange(buffers, o["chunk_size"], o["topk"], True, bins, sigmas, False)
            for r, e in enumerate(kept):
                self.errors[r][i] = e
        self.outer.step()
        with torch.no_grad():
            for model in self.replicas:
                for p, theta in zip(model.parameters(), self.theta):
                    p.copy_(theta)


DENSE = {"chunk_size": 8, "topk": 64, "quantization_bins": 0, "error_decay": 0.0, "outer_lr": 1.0}


def options(sparse: dict, replica_size: int = 1, inside: str = "fused_allreduce") -> dict:
    layout = {"replica_size": replica_size, "replica_mode": inside} if replica_size > 1 else {}
    return {"sync_every": H, **sparse, **layout}


def reference(rank: int, world: int, replica_size: int = 1, inside: str = "fused_allreduce") -> dict:
    torch.manual_seed(0)
    model = MLP()
    paper = AuthorsSparseLoCo(model, world // replica_size, SPARSE)
    step = transpile(
        model,
        inner_optimizer(model.parameters()),
        mode_config("sparseloco", **options(SPARSE, replica_size, inside)),
        LOSS,
    )
    record = side_by_side(step, model, paper, data(world, H * ROUNDS), rank, rank // replica_size)
    errors = {k: v for k, v in step.state_dict()["transpiler"]["extra"].items() if k.startswith("error_feedback.")}
    mine = paper.errors[rank // replica_size]
    record["errors"] = errors
    record["paper_errors"] = {f"error_feedback.{n}": e for n, e in zip(record["paper"][-1], mine)}
    return record


def identity(rank: int, world: int) -> dict:
    """Everything sent at full precision with no memory and α = 1 (which Δ enters the buffer with too):
    SparseLoCo is DiLoCo with outer SGD(lr=1), no momentum."""

    def sparseloco(model):
        return transpile(model, inner_optimizer(model.parameters()), mode_config("sparseloco", **options(DENSE)), LOSS)

    def diloco(model):
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        opt = inner_optimizer(model.parameters())
        return transpile(model, opt, DiLoCo(sync_every=H), LOSS, outer_optimizer=outer)

    return each_run(rank, world, ROUNDS, {"sparseloco": sparseloco, "diloco": diloco})


def resume(rank: int, world: int) -> dict:
    """``state_dict()`` one inner step into the second round; a fresh model, optimizer and step load it."""
    steps = data(world, H * 3)
    saved: dict = {}
    runs: dict = {}
    for how in ("straight", "resumed"):
        torch.manual_seed(0)
        model = MLP()
        step = transpile(model, inner_optimizer(model.parameters()), mode_config("sparseloco", **options(SPARSE)), LOSS)
        if how == "resumed":
            step.load_state_dict(saved)
        runs[how] = []
        for t, batches in enumerate(steps, start=1):
            if how == "resumed" and t <= H + 1:
                continue
            step(*batches[rank])
            runs[how].append(params_of(model) | {f"global.{n}": v.clone() for n, v in step.global_parameters().items()})
            if how == "straight" and t == H + 1:
                saved = copy.deepcopy(step.state_dict())
    runs["saved_errors"] = {k: v for k, v in saved["transpiler"]["extra"].items() if k.startswith("error_feedback.")}
    return runs


def wire(rank: int, world: int) -> dict:
    """The sync's collectives (kind, bytes of one rank's message) and the tiles of each parameter."""
    torch.manual_seed(0)
    model = MLP()
    step = transpile(model, inner_optimizer(model.parameters()), mode_config("sparseloco", **options(SPARSE)), LOSS)
    for batches in data(world, H):
        step(*batches[rank])
    sync = step.programs["sync"]
    sent = [n for n in sync.graph.nodes if "collective" in n.meta]
    return {
        "collectives": [(str(n.target), n.meta["collective"]["bytes"]) for n in sent],
        "parts": [n.meta["collective"]["parts"] for n in sent],
        "gathered": sent[0].meta["val"].numel() if sent else 0,
        "shapes": [tuple(p.shape) for p in model.parameters()],
    }


def checks(rank: int, world: int) -> dict:
    out = {"reference": reference(rank, world), "wire": wire(rank, world)}
    if world == 4:
        out["reference_2d"] = reference(rank, world, replica_size=2)
        out["reference_2d_zero1"] = reference(rank, world, replica_size=2, inside="zero1")
    if world == 2:
        out |= {"identity": identity(rank, world), "resume": resume(rank, world)}
    return out


if __name__ == "__main__":
    run_rank(checks)
