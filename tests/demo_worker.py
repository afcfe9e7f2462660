"""One rank of the DeMo runs (tests/test_demo.py), every rank on its own data, in the worlds of 2 and 4 ranks that
tests/test_diloco.py also uses.

1. ``reference``: ``demo`` (chunks of 16, top-3 DCT coefficients of each, 32-bit, β=0.9, sign step; plain SGD)
   for 8 steps against the paper's loop run eagerly here for every rank: ``m_r ← β m_r + g_r``; per chunk of
   ``m_r`` the coefficients ``c = x Dᵀ`` in the DCT-II basis ``D`` (scipy's, ``norm="ortho"``), the top-k kept
   (``q_r``) and taken out, ``m_r ← m_r − q_r D``; the update ``sign((Σ_r q_r) D / W)``, summed in rank order.
   Also with 4-bit coefficients.
2. ``identity``: every coefficient sent (k = chunk), no sign: the user's SGD with momentum on the mean gradient.
"""

from __future__ import annotations

import copy
import os
import sys

import numpy as np
import scipy.fft
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.diloco_worker import LOSS, data, params_of  # noqa: E402
from tests.distributed import run_rank  # noqa: E402
from tests.models import MLP  # noqa: E402
from tests.sparseloco_worker import keep_topk, rows_of  # noqa: E402
from transpiler import transpile  # noqa: E402

STEPS = 8
DEMO = {"compression_chunk": 16, "compression_topk": 3, "compression_decay": 0.9}


def dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix from scipy: column j is the transform of the j-th unit vector."""
    return torch.from_numpy(scipy.fft.dct(np.eye(n), type=2, norm="ortho", axis=0)).float()


class PaperDeMo:
    """Algorithm 1 of Peng et al. (2024), eager, for every rank: each keeps its momentum; the optimizer of every
    replica (the same SGD) steps on the shared update."""

    def __init__(self, model, world: int, chunk: int, k: int, bits: int, beta: float, sign: bool, optimizer):
        self.replicas = [copy.deepcopy(model) for _ in range(world)]
        self.optimizers = [optimizer(m.parameters()) for m in self.replicas]
        self.momenta = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(world)]
        self.chunk, self.k, self.bits, self.beta, self.sign = chunk, k, bits, beta, sign
        self.basis = dct(chunk)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for model, opt, (x, y) in zip(self.replicas, self.optimizers, batches):
            opt.zero_grad()
            LOSS(model(x), y).backward()
        world = len(self.replicas)
        updates = []
        for i, like in enumerate(self.replicas[0].parameters()):
            total = None
            for r, model in enumerate(self.replicas):
                m = self.beta * self.momenta[r][i] + list(model.parameters())[i].grad
                rows = rows_of(m, self.chunk)
                q = keep_topk(rows @ self.basis.T, self.k, self.bits)
                self.momenta[r][i] = (rows - q @ self.basis).reshape(-1)[: m.numel()].reshape(m.shape)
                total = q if total is None else total + q
            mean = ((total @ self.basis) * (1.0 / world)).reshape(-1)[: like.numel()].reshape(like.shape)
            updates.append(torch.sign(mean) if self.sign else mean)
        for model, opt in zip(self.replicas, self.optimizers):
            for p, update in zip(model.parameters(), updates):
                p.grad = update.clone()
            opt.step()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def reference(rank: int, world: int, bits: int) -> dict:
    torch.manual_seed(0)
    model = MLP()
    c, k, beta = DEMO["compression_chunk"], DEMO["compression_topk"], DEMO["compression_decay"]
    paper = PaperDeMo(model, world, c, k, bits, beta, True, sgd)
    step = transpile(model, sgd(model.parameters()), "demo", LOSS, **DEMO, value_bits=bits)
    record: dict = {"mine": [], "paper": []}
    for batches in data(world, STEPS):
        step(*batches[rank])
        paper.step(batches)
        record["mine"].append(params_of(model))
        record["paper"].append(params_of(paper.replicas[rank]))
    extra = step.state_dict()["transpiler"]["extra"]
    record["momenta"] = {n: extra[f"demo_momentum.{n}"] for n, _ in model.named_parameters()}
    record["paper_momenta"] = dict(zip(record["momenta"], paper.momenta[rank]))
    return record


def identity(rank: int, world: int) -> dict:
    """k = chunk and no sign against the mean gradient (summed in rank order) through SGD with momentum."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)

    def momentum_sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    options = {"compression_chunk": 16, "compression_topk": 16, "compression_decay": 0.9, "sign": False}
    step = transpile(model, momentum_sgd(model.parameters()), "demo", LOSS, **options)
    opt = momentum_sgd(twin.parameters())
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
            p.grad = total * (1.0 / world)
        opt.step()
        record["mine"].append(params_of(model))
        record["plain"].append(params_of(twin))
    return record


def checks(rank: int, world: int) -> dict:
    out = {"reference": reference(rank, world, 32), "reference_4bit": reference(rank, world, 4)}
    if world == 2:
        out["identity"] = identity(rank, world)
    return out


if __name__ == "__main__":
    run_rank(checks)
