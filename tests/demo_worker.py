"""One rank of the DeMo runs (tests/test_demo.py), every rank on its own data, in the worlds of 2 and 4 ranks that
tests/test_diloco.py also uses.

1. ``reference``: ``demo`` (tiles of at most 8 × 8, top-5 DCT coefficients of each, float32, β=0.9, sign step;
   plain SGD) for 8 steps against bloc97's ``DeMo`` optimizer run eagerly here for every rank
   (``AuthorsDeMo``: ``δ ← β·δ + lr·g``, the exchange of ``bench/authors_sparse.py`` with the 2-D DCT, the sign,
   SGD). Also with SparseLoCo's quantiser (4 bins), as tplr's optimizer runs DeMo with ``use_dct``.
   And with the authors' decoupled weight decay, ``θ ← θ·(1 − lr·λ)`` (the mode's ``weight_decay``).
2. ``sgd_decay``: SGD's own weight decay instead, against the authors' decoupled one.
3. ``identity``: every coefficient sent, no sign: the user's SGD on the mean of the momenta.
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
from tests.diloco_worker import LOSS, data, params_of  # noqa: E402
from transpiler import mode_config, transpile  # noqa: E402

STEPS = 8
DEMO = {"chunk_size": 8, "topk": 5, "compression_decay": 0.9}
LR = 0.01


class AuthorsDeMo:
    """bloc97's ``DeMo(torch.optim.SGD)``, eager, for every rank: each keeps its ``delta``; every rank's SGD steps
    on the same sign of the aggregate. ``weight_decay`` is theirs, decoupled: ``θ ← θ·(1 − lr·λ)`` first."""

    def __init__(self, model, world: int, options: dict, bins: int = 0, weight_decay: float = 0.0):
        self.replicas = [copy.deepcopy(model) for _ in range(world)]
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=LR, foreach=False) for m in self.replicas]
        self.deltas = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(world)]
        self.options, self.bins, self.weight_decay = options, bins, weight_decay

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        o = self.options
        for model, opt, (x, y) in zip(self.replicas, self.optimizers, batches):
            opt.zero_grad()
            LOSS(model(x), y).backward()
        for i in range(len(self.deltas[0])):
            buffers = []
            for r, model in enumerate(self.replicas):
                p = list(model.parameters())[i]
                if self.weight_decay:
                    p.data.mul_(1.0 - LR * self.weight_decay)
                delta = self.deltas[r][i]
                if o["compression_decay"] != 1:
                    delta = delta * o["compression_decay"]
                buffers.append(delta.add(p.grad, alpha=LR))
            chunk, topk = o["chunk_size"], o["topk"]
            self.deltas_for(i, *authors_sparse.exchange(buffers, chunk, topk, False, self.bins, 6, True))
        for opt in self.optimizers:
            opt.step()

    def deltas_for(self, i: int, kept: list[torch.Tensor], aggregate: torch.Tensor) -> None:
        for r, model in enumerate(self.replicas):
            self.deltas[r][i] = kept[r]
            list(model.parameters())[i].grad = aggregate.sign()


def sgd(params, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, weight_decay=weight_decay)


def reference(rank: int, world: int, bins: int = 0, weight_decay: float = 0.0, sgds: bool = False) -> dict:
    """``weight_decay``: the mode's (the authors' decoupled decay), or with ``sgds`` SGD's own."""
    torch.manual_seed(0)
    model = MLP()
    paper = AuthorsDeMo(model, world, DEMO, bins, weight_decay)
    options = {**DEMO, "quantization_bins": bins, "weight_decay": 0.0 if sgds else weight_decay}
    step = transpile(
        model, sgd(model.parameters(), weight_decay if sgds else 0.0), mode_config("demo", **options), LOSS
    )
    record: dict = {"mine": [], "paper": []}
    for batches in data(world, STEPS):
        step(*batches[rank])
        paper.step(batches)
        record["mine"].append(params_of(model))
        record["paper"].append(params_of(paper.replicas[rank]))
    extra = step.state_dict()["transpiler"]["extra"]
    record["momenta"] = {n: extra[f"demo_momentum.{n}"] for n, _ in model.named_parameters()}
    record["paper_momenta"] = dict(zip(record["momenta"], paper.deltas[rank]))
    return record


def identity(rank: int, world: int) -> dict:
    """Every coefficient, no memory (β = 0), no sign: plain SGD on the mean of ``lr·g`` (the lr enters the momentum
    and the step, as the authors' code has it), summed in rank order."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    options = {"chunk_size": 8, "topk": 64, "compression_decay": 0.0, "sign": False}
    step = transpile(model, sgd(model.parameters()), mode_config("demo", **options), LOSS)
    opt = sgd(twin.parameters())
    record: dict = {"mine": [], "plain": []}
    for batches in data(world, STEPS):
        step(*batches[rank])
        grads = []
        for x, y in batches:
            twin.zero_grad()
            LOSS(twin(x), y).backward()
            grads.append([p.grad.clone() for p in twin.parameters()])
        for i, p in enumerate(twin.parameters()):
            total = grads[0][i]
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total * (1.0 / world) * LR
        opt.step()
        record["mine"].append(params_of(model))
        record["plain"].append(params_of(twin))
    return record


def checks(rank: int, world: int) -> dict:
    out = {
        "reference": reference(rank, world),
        "reference_4bins": reference(rank, world, bins=4),
        "reference_decay": reference(rank, world, weight_decay=0.1),
    }
    if world == 2:
        out |= {"identity": identity(rank, world), "sgd_decay": reference(rank, world, weight_decay=0.1, sgds=True)}
    return out


if __name__ == "__main__":
    run_rank(checks)
