"""``transpiler::top_magnitudes``, top-K sparsification's selection: the ``k`` entries of largest ``|x|``, on the
candidates a sampled threshold keeps (CPU, ``k <= n / 64``) or by ``torch.topk``. Checked against ``torch.topk``
over the whole vector (the reference: torch's own selection), on data with ties, zeros, infinities and NaNs, on
vectors large enough to take the sampled path, and on data built so that the sample misjudges it (the fallback).

Cost: under 2 s on 2 cores (vectors of up to 1.3 million entries).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transpiler.graph.top_magnitudes import PARTIAL_SORT, SAMPLE, TOP_MAGNITUDES

pytestmark = pytest.mark.quick


def _check_is_a_top_k(x: torch.Tensor, k: int) -> None:
    """What topk guarantees, held to torch.topk's own choice: k distinct indices, no kept entry larger in
    magnitude than a chosen one (NaN the largest), and the same set as torch.topk where the k-th is not tied."""
    chosen = TOP_MAGNITUDES(x, k)
    assert chosen.dtype == torch.int64 and chosen.shape == (k,)
    assert chosen.unique().numel() == k
    key = torch.where(x.isnan(), torch.inf, x.abs())  # a NaN ranks above every number, as in torch.topk
    mask = torch.zeros_like(x, dtype=torch.bool).index_fill(0, chosen, True)
    if not mask.all():
        assert key[mask].min() >= key[~mask].max()
    reference = torch.topk(x.abs(), k).indices
    kth = key[reference].min()
    if int((key == kth).sum()) == 1:  # no tie at the k-th place: one right answer
        assert torch.equal(chosen.sort().values, reference.sort().values)
    else:  # the same multiset of magnitudes, whichever of the tied entries went
        assert torch.equal(key[chosen].sort().values, key[reference].sort().values)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 4000),
    share=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["normal", "few values", "zeros", "special"]),
)
def test_small_vectors_select_what_topk_selects(n, share, seed, kind) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "few values":  # many ties, of both signs
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif kind == "zeros":
        x = x * (torch.rand(n, generator=gen) < 0.1)
    elif kind == "special":
        x[torch.randint(0, n, (max(1, n // 10),), generator=gen)] = torch.tensor(float("nan"))
        x[torch.randint(0, n, (max(1, n // 10),), generator=gen)] = torch.tensor(float("-inf"))
    _check_is_a_top_k(x, max(1, round(share * n)))


@pytest.mark.parametrize("kind", ["normal", "sparse gradient", "ties", "nans"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 1 / PARTIAL_SORT])
def test_large_vectors_take_the_sampled_path_and_select_what_topk_selects(kind, ratio) -> None:
    n = 20 * SAMPLE + 7
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4)
    if kind == "sparse gradient":  # most entries exactly zero, as an unused embedding's rows leave them
        x = x * (torch.rand(n, generator=gen) < 0.02)
    elif kind == "ties":
        x = torch.randint(-50, 51, (n,), generator=gen).float()
    elif kind == "nans":
        x[torch.randint(0, n, (50,), generator=gen)] = torch.tensor(float("nan"))
    _check_is_a_top_k(x, int(ratio * n))


def test_a_sample_that_misjudges_the_data_falls_back_to_topk() -> None:
    """Large magnitudes only where the strided sample looks: the sample's threshold (about the 2k·m/n-th largest
    of its m entries, all large) keeps about k/8 entries of x, so the candidates cannot hold a top k (topk over
    them would raise) and the op must fall back to topk over x."""
    n = 16 * SAMPLE
    x = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[:: n // SAMPLE] += 10.0 + torch.rand(SAMPLE, generator=torch.Generator().manual_seed(2))
    _check_is_a_top_k(x, n // 100)
