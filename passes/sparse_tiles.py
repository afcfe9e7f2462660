"""Tiles of a tensor, as SparseLoCo's and DeMo's authors cut them, and DeMo's DCT basis.

Not a pass. A matrix ``[a, b]`` is cut into ``(a/h) × (b/w)`` tiles of ``h × w``; each side is the largest
divisor of its dimension not above ``chunk`` (:func:`tile_side`: 64 × 64 for 768 × 3072 with chunk 64, 64 × 10 for
64 × 10). A vector of ``n`` is cut into chunks of ``tile_side(n, chunk)``. A tensor of more than two dimensions
is taken as the matrix ``[shape[0], the product of the rest]`` and a 0-d one as a vector of one element (the
authors' code takes neither). Each tile is one row of ``h·w`` entries, row-major inside the tile (``[Y·X, h·w]``
for a matrix, ``[C, s]`` for a vector), which the top-k picks from.

With a basis (DeMo) a row holds the tile's coefficients instead: the DCT along both sides of the tile, ``Fᵀ T F``
written as the authors' ``einsum``, and the way back through the inverse ``B``. Both matrices are computed as the
authors compute them, from the identity through an FFT in float32 (:func:`dct_bases`); they differ from the
exact orthonormal DCT-II by up to 7.4e-8, about an ulp (``docs/strategies/demo.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def tile_side(n: int, chunk: int) -> int:
    """The largest divisor of ``n`` not above ``chunk`` (``n`` itself when ``n <= chunk``)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return max(d for d in small + [n // d for d in small] if d <= chunk)


@dataclass(frozen=True)
class Tiling:
    """How one tensor is cut: ``sides`` (``(h, w)`` for a matrix, ``(s,)`` for a vector) of ``matrix`` (the
    tensor as the 1-D or 2-D shape that is cut)."""

    shape: tuple[int, ...]
    matrix: tuple[int, ...]
    sides: tuple[int, ...]

    @classmethod
    def of(cls, shape: tuple[int, ...], chunk: int) -> Tiling:
        if len(shape) >= 2:
            matrix: tuple[int, ...] = (shape[0], math.prod(shape[1:]))
        else:
            matrix = (math.prod(shape),)
        return cls(tuple(shape), matrix, tuple(tile_side(n, chunk) for n in matrix))

    @property
    def width(self) -> int:
        """Entries of one tile: one row."""
        return math.prod(self.sides)

    @property
    def rows(self) -> int:
        return math.prod(self.matrix) // self.width


def to_rows(x: torch.Tensor, matrix: tuple[int, ...], sides: tuple[int, ...], *basis: torch.Tensor) -> torch.Tensor:
    """``x`` as its tiles (a :class:`Tiling`'s ``matrix`` and ``sides``: plain tuples, so a graph node can carry
    them), one per row (``[rows, width]``); with ``basis`` (``F`` of each side), each tile's coefficients."""
    if len(sides) == 1:
        (s,) = sides
        chunks = x.reshape(-1, s)
        if basis:
            chunks = torch.einsum("...ij, jb -> ...ib", chunks, basis[0])
        return chunks
    (a, b), (h, w) = matrix, sides
    grid = x.reshape(a // h, h, b // w, w)
    if basis:
        tiles = torch.einsum("...ijkl, jb, ld -> ...ikbd", grid, basis[0], basis[1])
    else:
        tiles = grid.permute(0, 2, 1, 3)
    return tiles.reshape(-1, h * w)


def from_rows(
    rows: torch.Tensor, shape: tuple[int, ...], matrix: tuple[int, ...], sides: tuple[int, ...], *basis: torch.Tensor
) -> torch.Tensor:
    """The tensor of ``shape`` whose :func:`to_rows` is ``rows`` (with ``basis``, ``B`` of each side: back from
    coefficients)."""
    if len(sides) == 1:
        if basis:
            rows = torch.einsum("...ij, jb -> ...ib", rows, basis[0])
        return rows.reshape(shape)
    (a, b), (h, w) = matrix, sides
    tiles = rows.reshape(a // h, b // w, h, w)
    if basis:
        grid = torch.einsum("...ijkl, kb, ld -> ...ibjd", tiles, basis[0], basis[1])
    else:
        grid = tiles.permute(0, 2, 1, 3)
    return grid.reshape(shape)


def dct_bases(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F, B)`` for tiles of side ``n``, float32: ``F`` the orthonormal DCT-II of each row of the identity (a row
    ``x`` has coefficients ``x F``), ``B`` the inverse transform of each row (``c B`` is back). Computed through an
    FFT of length ``n`` (Makhoul's reordering), as the authors' code does."""
    eye = torch.eye(n)
    return _dct_rows(eye), _idct_rows(eye)


def _twiddles(n: int, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``sign · πk / 2n`` for ``k < n``, float32."""
    angle = sign * torch.arange(n, dtype=torch.float32)[None, :] * math.pi / (2 * n)
    return torch.cos(angle), torch.sin(angle)


def _dct_rows(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of each row: even entries, then the odd ones reversed, through an FFT, each term
    turned by ``e^{-iπk/2n}``."""
    n = x.shape[-1]
    spectrum = torch.view_as_real(torch.fft.fft(torch.cat([x[:, ::2], x[:, 1::2].flip([1])], dim=1), dim=1))
    cos, sin = _twiddles(n, -1.0)
    out = spectrum[:, :, 0] * cos - spectrum[:, :, 1] * sin
    out[:, 0] /= math.sqrt(n) * 2
    out[:, 1:] /= math.sqrt(n / 2) * 2
    return 2 * out


def _idct_rows(c: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_dct_rows` on each row, through an inverse real FFT."""
    n = c.shape[-1]
    half = c.contiguous() / 2
    half[:, 0] *= math.sqrt(n) * 2
    half[:, 1:] *= math.sqrt(n / 2) * 2
    cos, sin = _twiddles(n, 1.0)
    imag = torch.cat([half[:, :1] * 0, -half.flip([1])[:, :-1]], dim=1)
    turned = torch.stack([half * cos - imag * sin, half * sin + imag * cos], dim=2)
    v = torch.fft.irfft(torch.view_as_complex(turned), n=n, dim=1)
    x = v.new_zeros(v.shape)
    x[:, ::2] += v[:, : n - n // 2]
    x[:, 1::2] += v.flip([1])[:, : n // 2]
    return x
