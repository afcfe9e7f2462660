"""SparseLoCo's and DeMo's exchange as their authors' code computes it, written here from reading that code and
imported from nowhere in the project (``transpiler/``, ``passes/``): tplr's ``SparseLoCo`` optimizer
(``src/tplr/sparseloco.py`` as ``QErywan/RobustDiLoCo`` holds it, commit 276fa59) and ``bloc97/DeMo``'s ``DeMo``
optimizer. The tests hold the modes to it; ``bench/sparseloco_peer.py`` runs tplr's loop with its tiles and
quantiser.

One call of :func:`exchange` is one parameter's communication for every rank at once: each rank's buffer is cut
into tiles (``_get_smaller_split``: each side the largest divisor not above the chunk), optionally turned into 2-D
DCT coefficients (``einsum`` with the FFT-built bases), the top-k of each tile kept (``sorted=False``), quantised
with the statistical quantiser (SparseLoCo), taken out of the buffer, and the ranks' indices and values
concatenated in rank order into one ``scatter_reduce(mean, include_self=False)``.
"""

from __future__ import annotations

import math

import torch


def smaller_split(n: int, close_to: int) -> int:
    """The authors' ``_get_smaller_split``: walk the sorted divisors of ``n``; the one equal to ``close_to``, or the
    one before the first above it, or ``n``."""
    divisors = sorted(d for d in range(1, n + 1) if n % d == 0)
    for i, d in enumerate(divisors):
        if d == close_to:
            return d
        if d > close_to:
            return d if i == 0 else divisors[i - 1]
    return n


def fft_dct(eye: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The authors' ``_dct(I, norm="ortho")`` (or ``_idct``), zh217's torch-dct, on an identity matrix."""
    n = eye.shape[-1]
    if not inverse:
        v = torch.cat([eye[:, ::2], eye[:, 1::2].flip([1])], dim=1)
        vc = torch.view_as_real(torch.fft.fft(v, dim=1))
        k = -torch.arange(n, dtype=eye.dtype)[None, :] * math.pi / (2 * n)
        out = vc[:, :, 0] * torch.cos(k) - vc[:, :, 1] * torch.sin(k)
        out[:, 0] /= math.sqrt(n) * 2
        out[:, 1:] /= math.sqrt(n / 2) * 2
        return 2 * out
    xv = eye.contiguous().view(-1, n) / 2
    xv[:, 0] *= math.sqrt(n) * 2
    xv[:, 1:] *= math.sqrt(n / 2) * 2
    k = torch.arange(n, dtype=eye.dtype)[None, :] * math.pi / (2 * n)
    wr, wi = torch.cos(k), torch.sin(k)
    vi = torch.cat([xv[:, :1] * 0, -xv.flip([1])[:, :-1]], dim=1)
    spectrum = torch.cat([(xv * wr - vi * wi).unsqueeze(2), (xv * wi + vi * wr).unsqueeze(2)], dim=2)
    v = torch.fft.irfft(torch.view_as_complex(spectrum), n=n, dim=1)
    x = v.new_zeros(v.shape)
    x[:, ::2] += v[:, : n - (n // 2)]
    x[:, 1::2] += v.flip([1])[:, : n // 2]
    return x


class Tiles:
    """tplr's ``ChunkingTransform`` / bloc97's ``TransformDCT`` for one tensor shape (1-D or 2-D)."""

    def __init__(self, shape: torch.Size, chunk: int, dct: bool):
        self.shape, self.dct = shape, dct
        self.sides = [smaller_split(s, chunk) for s in shape]
        self.f = [fft_dct(torch.eye(s), False) for s in self.sides]
        self.b = [fft_dct(torch.eye(s), True) for s in self.sides]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """1-D: ``[c, s]``; 2-D: ``[y, x, h·w]`` (the compressor's flattened tiles)."""
        if x.ndim == 1:
            chunks = x.reshape(-1, self.sides[0])
            return torch.einsum("...ij, jb -> ...ib", chunks, self.f[0]) if self.dct else chunks
        (a, b), (h, w) = self.shape, self.sides
        if self.dct:  # bloc97: "(y h) (x w) -> y h x w", then the 2-D DCT with the tile axes moved together
            tiles = torch.einsum("...ijkl, jb, ld -> ...ikbd", x.reshape(a // h, h, b // w, w), self.f[0], self.f[1])
        else:  # tplr: "(y h) (x w) -> y x h w"
            tiles = x.reshape(a // h, h, b // w, w).permute(0, 2, 1, 3)
        return tiles.reshape(a // h, b // w, h * w)

    def decode(self, t: torch.Tensor) -> torch.Tensor:
        if len(self.shape) == 1:
            return (torch.einsum("...ij, jb -> ...ib", t, self.b[0]) if self.dct else t).reshape(self.shape)
        (a, b), (h, w) = self.shape, self.sides
        tiles = t.reshape(a // h, b // w, h, w)
        if self.dct:
            grid = torch.einsum("...ijkl, kb, ld -> ...ibjd", tiles, self.b[0], self.b[1])
        else:
            grid = tiles.permute(0, 2, 1, 3)
        return grid.reshape(self.shape)


def quantise(val: torch.Tensor, bins: int, sigmas: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tplr's ``TopKCompressor._quantize``: uint8 codes, the shift and the lookup of bin means."""
    offset = bins // 2
    shift = val.mean()
    centred = val - shift
    std = centred.norm() / math.sqrt(centred.numel() - 1) if centred.numel() > 1 else torch.tensor(0.0)
    scale = sigmas * std / bins
    if scale == 0 or torch.isnan(scale) or torch.isinf(scale):
        scale = torch.tensor(1.0)
    codes = (centred.float() / scale + offset).round().clamp(0, bins - 1).to(torch.uint8)
    sums = torch.zeros(bins).scatter_add_(0, codes.long().flatten(), centred.float().flatten())
    counts = torch.zeros(bins).scatter_add_(0, codes.long().flatten(), torch.ones_like(centred.float().flatten()))
    return codes, shift, torch.where(counts > 0, sums / counts, 0.0)


def exchange(
    buffers: list[torch.Tensor], chunk: int, topk: int, scaled: bool, bins: int, sigmas: float, dct: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's buffer of one parameter in, rank order: each buffer with what it sent taken out, and the
    aggregate every rank decodes. ``scaled``: tplr's k for a tile of ``n`` entries without DCT,
    ``int(max(1, round(n·topk / chunk²)))``; else ``topk``. Either is clamped to the tile (``_clamp_topk``)."""
    tiles = Tiles(buffers[0].shape, chunk, dct)
    kept, indices, values = [], [], []
    for e in buffers:
        x = tiles.encode(e)
        k = int(max(1, round(x.shape[-1] * topk / chunk**2))) if scaled else topk
        k = min(max(k, 1), x.shape[-1])
        idx = torch.topk(x.abs(), k=k, dim=-1, largest=True, sorted=False).indices
        val = torch.gather(x, dim=-1, index=idx)
        if bins:
            codes, shift, lookup = quantise(val, bins, sigmas)
            val = (lookup[codes.long()] + shift).to(torch.float32)
        local = torch.zeros_like(x).scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
        kept.append(e - tiles.decode(local))
        indices.append(idx)
        values.append(val)
    shape = tiles.encode(buffers[0]).shape
    total = torch.zeros(shape).scatter_reduce_(
        -1, torch.cat(indices, dim=-1), torch.cat(values, dim=-1), reduce="mean", include_self=False
    )
    return kept, tiles.decode(total)
