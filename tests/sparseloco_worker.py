"""One rank of the SparseLoCo runs (tests/test_sparseloco.py), every rank on its own data, in the worlds of 2 and 4
ranks that tests/test_diloco.py also uses.

1. ``reference``: ``sparseloco`` (H=3, AdamW inside; 16-element chunks, top-3 of each, 2-bit values, β=0.9,
   α=0.8) for 4 outer rounds, against the paper's loop that this rank runs eagerly for *every* replica:
   ``e_r ← β e_r + (θ_global − θ_r)``; per chunk of ``e_r`` (each parameter flattened, padded with zeros to whole
   chunks) the ``k`` entries of largest ``|e|``, quantised as docs/strategies/sparseloco.md writes it and decoded
   (``ê_r``); ``e_r ← e_r − ê_r``; ``θ_global ← θ_global − α · (ê_0 + ê_1 + ...) / W``, summed in rank order;
   every replica restarts from θ_global. The quantiser is written here from the documented formula, not imported.
   ``replica_size=2`` at W=4: two replicas of two ranks, data parallel or ZeRO-1 inside.
2. ``identity``: k = chunk, 32-bit values and β = 0 against ``diloco`` with outer ``SGD(lr=α)``.
3. ``resume``: ``step.state_dict()`` mid-round (the error buffers non-zero) continues as the run that never stopped.
4. ``wire``: the bytes of the all-gather's message, and the verifier refusing an error buffer that leaves the rank.
"""

from __future__ import annotations

import copy
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
from tests.distributed import run_rank  # noqa: E402
from tests.models import MLP  # noqa: E402
from transpiler import transpile  # noqa: E402

ROUNDS = 4
SPARSE = {"chunk_size": 16, "topk": 3, "value_bits": 2, "error_decay": 0.9, "outer_lr": 0.8}


def rows_of(e: torch.Tensor, chunk: int) -> torch.Tensor:
    """``e`` flattened and padded with zeros to whole chunks, one per row."""
    return torch.cat([e.reshape(-1), e.new_zeros((-e.numel()) % chunk)]).reshape(-1, chunk)


def keep_topk(rows: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """The compressor as the docs state it: per row the top-k of ``|x|``, each value ``v`` of a row whose largest
    is ``s`` coded ``q = clamp(round((v/s + 1)·L/2), 0, L)`` and decoded ``(2q − L)·(s/L)`` (``L = 2^bits − 1``;
    32 bits: ``v`` itself). Returns the decoded values in place, zero elsewhere."""
    where = rows.abs().topk(k, dim=1).indices
    v = rows.gather(1, where)
    if bits < 32:
        levels = 2**bits - 1
        s = v.abs().amax(1, keepdim=True)
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.clamp(torch.round((v / s + 1) * (levels / 2)), 0, levels)
        v = (2 * q - levels) * (s / levels)
    return torch.zeros_like(rows).scatter(1, where, v)


def compress(e: torch.Tensor, chunk: int, k: int, bits: int) -> torch.Tensor:
    """SparseLoCo's compressor on a whole buffer: :func:`keep_topk` of its chunks, back in its shape."""
    return keep_topk(rows_of(e, chunk), k, bits).reshape(-1)[: e.numel()].reshape(e.shape)


class PaperSparseLoCo(PaperDiLoCo):
    """SparseLoCo (Sarfi et al., 2025), eager, for all replicas: each replica's error buffer takes its Δ, sends
    what :func:`compress` keeps and keeps the rest; θ_global takes SGD(lr=α) on the mean of what was sent."""

    def __init__(self, model, replicas: int, chunk: int, k: int, bits: int, beta: float, alpha: float):
        super().__init__(model, replicas, outer_lr=alpha, momentum=0.0)
        self.chunk, self.k, self.bits, self.beta = chunk, k, bits, beta
        self.errors = [[torch.zeros_like(t) for t in self.theta] for _ in range(replicas)]

    def sync(self) -> None:
        for i, theta in enumerate(self.theta):
            total = torch.zeros_like(theta)
            for r, model in enumerate(self.replicas):
                e = self.beta * self.errors[r][i] + (theta.detach() - list(model.parameters())[i].detach())
                sent = compress(e, self.chunk, self.k, self.bits)
                self.errors[r][i] = e - sent
                total = total + sent
            theta.grad = total * (1.0 / len(self.replicas))
        self.outer.step()
        with torch.no_grad():
            for model in self.replicas:
                for p, theta in zip(model.parameters(), self.theta):
                    p.copy_(theta)


def options(sparse: dict, replica_size: int = 1, inside: str = "fused_allreduce") -> dict:
    layout = {"replica_size": replica_size, "replica_mode": inside} if replica_size > 1 else {}
    return {"sync_every": H, **sparse, **layout}


def reference(rank: int, world: int, replica_size: int = 1, inside: str = "fused_allreduce") -> dict:
    torch.manual_seed(0)
    model = MLP()
    s = SPARSE
    paper = PaperSparseLoCo(
        model, world // replica_size, s["chunk_size"], s["topk"], s["value_bits"], s["error_decay"], s["outer_lr"]
    )
    step = transpile(model, inner_optimizer(model.parameters()), "sparseloco", LOSS, **options(s, replica_size, inside))
    record = side_by_side(step, model, paper, data(world, H * ROUNDS), rank, rank // replica_size)
    errors = {k: v for k, v in step.state_dict()["transpiler"]["extra"].items() if k.startswith("error_feedback.")}
    mine = paper.errors[rank // replica_size]
    record["errors"] = errors
    record["paper_errors"] = {f"error_feedback.{n}": e for n, e in zip(record["paper"][-1], mine)}
    return record


def identity(rank: int, world: int) -> dict:
    """Everything sent at full precision with no memory: SparseLoCo is DiLoCo with outer SGD(lr=α), no momentum."""

    def sparseloco(model):
        dense = {"chunk_size": 16, "topk": 16, "value_bits": 32, "error_decay": 0.0, "outer_lr": 0.8}
        return transpile(model, inner_optimizer(model.parameters()), "sparseloco", LOSS, **options(dense))

    def diloco(model):
        outer = torch.optim.SGD(model.parameters(), lr=0.8)
        opt = inner_optimizer(model.parameters())
        return transpile(model, opt, "diloco", LOSS, sync_every=H, outer_optimizer=outer)

    return each_run(rank, world, ROUNDS, {"sparseloco": sparseloco, "diloco": diloco})


def resume(rank: int, world: int) -> dict:
    """``state_dict()`` one inner step into the second round; a fresh model, optimizer and step load it."""
    steps = data(world, H * 3)
    saved: dict = {}
    runs: dict = {}
    for how in ("straight", "resumed"):
        torch.manual_seed(0)
        model = MLP()
        step = transpile(model, inner_optimizer(model.parameters()), "sparseloco", LOSS, **options(SPARSE))
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
    """The sync's collectives (kind, bytes of one rank's message) and the message's length on the wire."""
    torch.manual_seed(0)
    model = MLP()
    step = transpile(model, inner_optimizer(model.parameters()), "sparseloco", LOSS, **options(SPARSE))
    for batches in data(world, H):
        step(*batches[rank])
    sync = step.programs["sync"]
    sent = [n for n in sync.graph.nodes if "collective" in n.meta]
    gathered = sent[0].meta["val"].numel() if sent else 0
    rows = sum(math.ceil(p.numel() / SPARSE["chunk_size"]) for p in model.parameters())
    return {
        "collectives": [(str(n.target), n.meta["collective"]["bytes"]) for n in sent],
        "gathered": gathered,
        "rows": rows,
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
