"""The least-squares problems the DimReduce tests share (the test, and each rank of its worlds).

A linear model ``y = x wᵀ + b`` under mean squared error, so the loss is a
convex quadratic in the 9 weights. The basis spans a known 5-dimensional
subspace: 5 orthonormal rows from a QR factorisation. Each step takes a new
batch, so the curvature the quasi-Newton model learnt is sometimes wrong for
the next batch: over the 6 steps the full step (rho^0), the shorter one
(rho^1) and the fallback (neither) all happen.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

D_IN, COMPONENTS, GLOBAL, STEPS = 8, 5, 12, 6  # a global batch of 12 splits evenly over 1, 2 or 3 ranks
SCALE = 0.6  # of the inputs, so of the curvature
LR = 1.0  # Boost's SGD(learning_rate=1)


def model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(D_IN, 1)


def batches(steps: int = STEPS, scale: float = SCALE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches, the same at every world size."""
    gen = torch.Generator().manual_seed(7)
    truth = torch.randn(D_IN, 1, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(GLOBAL, D_IN, generator=gen) * scale
        out.append((x, x @ truth + 0.1 * torch.randn(GLOBAL, 1, generator=gen)))
    return out


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s equal share of a global batch."""
    size = GLOBAL // world
    return batch[0][rank * size : (rank + 1) * size], batch[1][rank * size : (rank + 1) * size]


def basis_rows(components: int = COMPONENTS, n: int = D_IN + 1) -> torch.Tensor:
    """``components`` orthonormal rows spanning a fixed subspace of the ``n`` weights."""
    gen = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(n, components, generator=gen, dtype=torch.float64))
    return q.T.float().contiguous()


def write_basis(path: Path, rows: torch.Tensor) -> Path:
    """A basis file as ``transpiler pca`` writes it, for the linear model's layout."""
    torch.save({"pca_mat": rows, "names": ["weight", "bias"], "shapes": [[1, D_IN], [1]]}, path)
    return path
