"""``transpiler::top_magnitudes(x, k)``: the indices of the ``k`` entries of a 1-D ``x`` with the largest ``|x|``
(a NaN counts as the largest, as in ``torch.topk``), in no particular order: the selection of top-K gradient
sparsification (``sparse-allreduce``).

Why not ``torch.topk(x.abs(), k)``: on the CPU, for ``k <= n / 64`` (1% sparsification is ``k = n / 100``), ATen's
topk runs ``std::partial_sort`` over all ``n`` entries, O(n log k): 46 ms for ``k`` = 31,000 of 3.1 million (one
thread, 2-core Xeon), the costliest op of the wide GPT's sparsified step in ``python -m bench.peers``. Here the
threshold comes from a strided sample of 65,536 entries (its ``rank``-th largest, ``rank`` chosen so that about
``2k`` entries of ``x`` reach it),
one comparison over ``x`` keeps those candidates, and topk runs over the candidates only (its ``nth_element`` path,
O(candidates)): 12 ms on the same data. Should fewer than ``k`` reach the threshold (a sample that misjudged the
data), it falls back to topk over ``x``. The set is topk's whenever the magnitudes at the ``k``-th place are not
tied; among tied entries either picks any (the values sent are equal in magnitude; ``tests/test_top_magnitudes.py``).
On another device (a GPU's topk is a radix select, and this would sync the host on the candidates' count) it is
``torch.topk``.
"""

from __future__ import annotations

import math

import torch

SAMPLE = 65_536  # entries of x the threshold is estimated from
MARGIN = 2.0  # candidates aimed for, as a multiple of k
PARTIAL_SORT = 64  # ATen's CPU topk sorts partially (O(n log k)) when k * 64 <= n; above, it already selects in O(n)


@torch.library.custom_op("transpiler::top_magnitudes", mutates_args=())
def top_magnitudes(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64) of the ``k`` entries of 1-D ``x`` of largest magnitude, unordered (module docstring)."""
    magnitudes = x.abs()
    n = magnitudes.numel()
    if x.device.type != "cpu" or k * PARTIAL_SORT > n or n <= SAMPLE:
        return torch.topk(magnitudes, k, sorted=False).indices
    sample = magnitudes[:: n // SAMPLE]
    m = sample.numel()
    rank = min(m, math.ceil(MARGIN * k * m / n) + 16)  # the sample's rank-th largest: about MARGIN * k reach it
    threshold = sample.kthvalue(m - rank + 1).values
    candidates = torch.lt(magnitudes, threshold).logical_not_().nonzero().squeeze(1)  # >= threshold, or NaN
    if candidates.numel() < k:
        return torch.topk(magnitudes, k, sorted=False).indices
    return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]


@top_magnitudes.register_fake
def _top_magnitudes_fake(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.new_empty(k, dtype=torch.int64)


TOP_MAGNITUDES = torch.ops.transpiler.top_magnitudes.default  # the op a graph calls
