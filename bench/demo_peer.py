"""bloc97's DeMo optimizer as its users run it: eager, one parameter after another, written here from reading
``demo.py`` in github.com/bloc97/DeMo (commit cab4606), the peer of the ``demo`` mode in ``bench/sparse_ops.py``.

Each step, per parameter: the momentum decayed and the gradient added (``δ = β·δ + lr·g``), the 2-D DCT of each
tile (``einsum`` with the bases, each side the largest divisor of the dimension not above the chunk), the top-k
coefficients per tile (``sorted=False``), what they decode to taken out of the momentum, the indices and values
all-gathered (two collectives, started together, waited together), every rank's coefficients averaged by
``scatter_reduce(mean, include_self=False)``, decoded into the gradient, its sign taken; then SGD's for-loop step
(``foreach=False``), as their class derives from ``torch.optim.SGD``. Weight decay and ``einops`` are left out (the
bench runs without decay; ``reshape`` and ``permute`` stand in for ``rearrange``). Not the project's code: the
bases come from ``passes/sparse_tiles.py`` (the same FFT construction as theirs, tested against it), nothing else.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from passes.sparse_tiles import dct_bases, tile_side


class AuthorsDeMo(torch.optim.SGD):
    """The authors' ``DeMo(params, compression_decay, compression_topk, compression_chunk, lr=...)``."""

    def __init__(self, params, lr: float, decay: float = 0.999, topk: int = 32, chunk: int = 64) -> None:
        super().__init__(params, lr=lr, foreach=False)
        self.decay, self.topk, self.chunk = decay, topk, chunk
        for p in (p for g in self.param_groups for p in g["params"]):
            self.state[p]["delta"] = torch.zeros_like(p)  # as theirs keeps it: in the optimizer's state
        sides = {tile_side(n, chunk) for g in self.param_groups for p in g["params"] for n in p.shape}
        self.bases = {side: dct_bases(side) for side in sides}

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """Tiles' coefficients: ``[Y, X, h, w]`` for a matrix, ``[C, s]`` for a vector."""
        if x.dim() > 1:
            h, w = tile_side(x.shape[0], self.chunk), tile_side(x.shape[1], self.chunk)
            grid = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w)
            return torch.einsum("...ijkl, jb, ld -> ...ikbd", grid, self.bases[h][0], self.bases[w][0])
        s = tile_side(x.shape[0], self.chunk)
        return torch.einsum("...ij, jb -> ...ib", x.reshape(-1, s), self.bases[s][0])

    def _decode(self, c: torch.Tensor) -> torch.Tensor:
        if c.dim() > 2:
            y, x, h, w = c.shape
            grid = torch.einsum("...ijkl, kb, ld -> ...ibjd", c, self.bases[h][1], self.bases[w][1])
            return grid.reshape(y * h, x * w)
        return torch.einsum("...ij, jb -> ...ib", c, self.bases[c.shape[1]][1]).reshape(-1)

    @staticmethod
    def _mean(shape: torch.Size, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        """The coefficients ``idx``/``val`` (rows of tiles) scattered as their mean where any was sent."""
        flat = torch.zeros(*shape[:-2], shape[-2] * shape[-1]) if len(shape) > 2 else torch.zeros(shape)
        flat.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
        return flat.reshape(shape)

    @torch.no_grad()
    def step(self, closure=None):
        world = dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                delta = self.state[p]["delta"]
                delta.mul_(self.decay).add_(p.grad, alpha=group["lr"])
                coefficients = self._encode(delta)
                rows = coefficients.reshape(*coefficients.shape[:-2], -1) if coefficients.dim() > 2 else coefficients
                k = min(max(self.topk, 1), rows.shape[-1])
                idx = torch.topk(rows.abs(), k=k, dim=-1, largest=True, sorted=False).indices
                val = torch.gather(rows, -1, idx)
                delta.sub_(self._decode(self._mean(coefficients.shape, idx, val)))
                idx_all = [torch.zeros_like(idx) for _ in range(world)]
                val_all = [torch.zeros_like(val) for _ in range(world)]
                handles = [dist.all_gather(idx_all, idx, async_op=True), dist.all_gather(val_all, val, async_op=True)]
                for handle in handles:
                    handle.wait()
                mean = self._mean(coefficients.shape, torch.cat(idx_all, -1), torch.cat(val_all, -1))
                p.grad.copy_(self._decode(mean))
                p.grad.sign_()
        return super().step(closure)
