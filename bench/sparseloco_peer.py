"""tplr's SparseLoCo as its users run it: the ``Diloco`` strategy's loop driving the ``SparseLoCo`` optimizer, eager,
one parameter after another; the peer of the ``sparseloco`` mode in ``bench/peers.py``.

Written here from reading ``src/tplr/strategies.py`` and ``src/tplr/sparseloco.py`` (``QErywan/RobustDiLoCo``,
commit 276fa59). Each round: the parameters saved (``_get_offloaded_param``, a clone), ``H`` inner steps of the
inner optimizer on this rank's batches alone; then ``outer_step``: each parameter's gradient set to ``saved −
param`` and the parameter set back to ``saved``, and ``SparseLoCo.step()``: per parameter, the error buffer decayed
and the gradient added (``e ← β·e + lr·Δ``), cut into tiles, the top-k of each tile (k scaled to the tile) quantised
(the statistical quantiser, uint8 codes), what they decode to taken out of the buffer, then three blocking
all-gathers (the quantiser's shift and bin means, the indices, the codes), every rank's values dequantised and
averaged by ``scatter_reduce(mean, include_self=False)`` into the gradient, and SGD's for-loop step. The tiles and
quantiser are ``bench/authors_sparse.py``'s (the tests hold the mode to them). Left out, as the mode has them
not: the inner loop's gradient clipping, scheduler and bfloat16 autocast, and the random-k, DCT and sign options.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from bench.authors_sparse import Tiles, quantise


class TplrSparseLoCo(torch.optim.SGD):
    """tplr's ``SparseLoCo(params, lr, error_decay, top_k, chunk_size, use_quantization=True, ...)``."""

    def __init__(self, params, lr: float, error_decay: float, topk: int, chunk: int, bins: int, sigmas: float) -> None:
        super().__init__(params, lr=lr, foreach=False)
        self.decay, self.topk, self.chunk, self.bins, self.sigmas = error_decay, topk, chunk, bins, sigmas
        self.tiles: dict[torch.Size, Tiles] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["error_buffer"] = torch.zeros_like(p)
                self.tiles.setdefault(p.shape, Tiles(p.shape, chunk, dct=False))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.copy_(self._exchange(p, group["lr"]))
        return super().step(closure)

    def _exchange(self, p: torch.Tensor, lr: float) -> torch.Tensor:
        """The error buffer's tiles' top-k, quantised, sent; every rank's mean, decoded."""
        error, tiles = self.state[p]["error_buffer"], self.tiles[p.shape]
        if self.decay != 1.0:
            error.mul_(self.decay)
        error.add_(p.grad, alpha=lr)
        x = tiles.encode(error)
        k = min(max(int(max(1, round(x.shape[-1] * self.topk / self.chunk**2))), 1), x.shape[-1])
        idx = torch.topk(x.abs(), k=k, dim=-1, largest=True, sorted=False).indices
        codes, shift, lookup = quantise(torch.gather(x, -1, idx), self.bins, self.sigmas)
        error.sub_(tiles.decode(_mean(x.shape, idx, (lookup[codes.long()] + shift).to(torch.float32))))
        stats, indices, sent = _gather(torch.cat([shift.view(1), lookup])), _gather(idx), _gather(codes)
        values = [(s[1:][c.long()] + s[:1]).to(torch.float32) for s, c in zip(stats, sent)]
        return tiles.decode(_mean(x.shape, torch.cat(indices, -1), torch.cat(values, -1)))


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """tplr's ``_all_gather_tensor``: one blocking all-gather into a list."""
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _mean(shape: torch.Size, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """``decompress``/``batch_decompress``: the values scattered as their mean where any was sent."""
    return torch.zeros(shape).scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)


class TplrDiLoCo:
    """tplr's ``Diloco`` strategy on one rank: inner steps alone, every ``sync_every`` the outer step above."""

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer, outer: TplrSparseLoCo, sync_every: int):
        self.model, self.inner, self.outer, self.sync_every = model, inner, outer, sync_every
        self.loss_fn, self.t = nn.CrossEntropyLoss(), 0
        self.saved = self._offload()

    def _offload(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.inner.zero_grad()
        self.loss_fn(self.model(x), y).backward()
        self.inner.step()
        self.t += 1
        if self.t % self.sync_every:
            return
        with torch.no_grad():
            for saved, p in zip(self.saved, self.model.parameters()):
                p.grad = saved - p
                p.copy_(saved)
        self.outer.step()
        self.saved = self._offload()

    def kept(self) -> list[torch.Tensor]:
        """What the loop holds besides the model and the inner optimizer: the error buffers and the saved weights."""
        return [s["error_buffer"] for s in self.outer.state.values()] + self.saved
