"""The cost model behind ``bucket_cap_mb="auto"``: its fit, its simulation and the caps it picks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from passes.bucket_plan import CANDIDATE_MB, choose_caps
from passes.bucketing import MB, assign_buckets
from transpiler.graph.cost_model import CostModel, fit_alpha_beta

pytestmark = pytest.mark.quick  # the quick tier: 2 s


@given(alpha=st.floats(1e-6, 1e-2), beta=st.floats(1e-11, 1e-8))
def test_fit_recovers_latency_and_bandwidth(alpha, beta):
    sizes = [4096.0, 65536.0, 524288.0, 4194304.0, 16777216.0]
    got = fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert got == pytest.approx((alpha, beta), rel=1e-6, abs=1e-12)


def test_fit_never_gives_negative_costs():
    assert fit_alpha_beta([1.0, 2.0], [2.0, 1.0]) == (1.5, 0.0)


def _layers(n: int, mib: float, gap: float) -> tuple[list[str], list[int], dict[str, float]]:
    names = [f"p{i}" for i in range(n)]
    ready = {name: (i + 1) * gap for i, name in enumerate(names)}
    return names, [int(mib * MB)] * n, ready


def test_high_latency_prefers_one_bucket():
    names, nbytes, ready = _layers(16, 0.5, 1e-4)
    model = CostModel(alpha=0.05, beta=1e-10, ready=ready, backward=16e-4)
    choice = choose_caps(model, names, nbytes, [("f32", "cpu")] * 16)
    assert choice.buckets == 1
    assert choice.predicted_s <= choice.default_predicted_s


def test_slow_backward_and_cheap_latency_prefer_small_buckets():
    """Gradients ready 10 ms apart, each 4 MiB taking ~4 ms: reducing each as it comes hides nearly all."""
    names, nbytes, ready = _layers(8, 4.0, 1e-2)
    model = CostModel(alpha=1e-5, beta=1e-9, ready=ready, backward=8e-2)
    choice = choose_caps(model, names, nbytes, [("f32", "cpu")] * 8)
    assert choice.buckets > choice.default_buckets
    assert choice.predicted_s < choice.default_predicted_s
    assert choice.predicted_s == pytest.approx(8e-2 + 1e-5 + 4 * MB * 1e-9, rel=1e-6)  # only the last is exposed


@given(
    sizes=st.lists(st.integers(1, 8 * MB), min_size=1, max_size=30),
    alpha=st.floats(0, 1e-2),
    beta=st.floats(0, 1e-8),
    gap=st.floats(0, 1e-2),
)
def test_choice_is_never_predicted_worse_than_any_candidate(sizes, alpha, beta, gap):
    names = [f"p{i}" for i in range(len(sizes))]
    ready = {n: (i + 1) * gap for i, n in enumerate(names)}
    model = CostModel(alpha, beta, ready, backward=len(sizes) * gap)
    keys = [("f32", "cpu")] * len(sizes)
    choice = choose_caps(model, names, sizes, keys)
    assert choice.first_bucket_mb <= choice.bucket_cap_mb
    for cap in CANDIDATE_MB:
        plan = assign_buckets(sizes, keys, int(cap * MB), int(cap * MB))
        assert choice.predicted_s <= model.finish(plan, names, sizes) * 1.02 + 1e-12
    assert choice.predicted_s <= choice.default_predicted_s * 1.02 + 1e-12


def test_contention_makes_overlap_cost_compute():
    """Where overlapping takes the backward's cores (contention 1), splitting buys nothing: fewest buckets win."""
    names, nbytes, ready = _layers(8, 4.0, 1e-2)
    free = choose_caps(CostModel(1e-4, 1e-9, ready, 8e-2, contention=0.0), names, nbytes, [("f32", "cpu")] * 8)
    busy = choose_caps(CostModel(1e-4, 1e-9, ready, 8e-2, contention=1.0), names, nbytes, [("f32", "cpu")] * 8)
    assert free.buckets > 1
    assert busy.buckets == 1
    assert busy.predicted_s > free.predicted_s


@given(
    sizes=st.lists(st.integers(1, 8 * MB), min_size=1, max_size=20),
    gap=st.floats(0, 1e-2),
    contention=st.floats(0, 1),
    cap=st.sampled_from(CANDIDATE_MB),
)
def test_predicted_end_lies_between_overlap_and_no_overlap(sizes, gap, contention, cap):
    """No plan ends before the backward or before all its all-reduces, nor after doing them one after another."""
    names = [f"p{i}" for i in range(len(sizes))]
    model = CostModel(1e-4, 1e-9, {n: (i + 1) * gap for i, n in enumerate(names)}, len(sizes) * gap, contention)
    plan = assign_buckets(sizes, [("f32", "cpu")] * len(sizes), int(cap * MB), int(cap * MB))
    comm = sum(model.all_reduce_seconds(sum(sizes[i] for i in b)) for b in plan)
    end = model.finish(plan, names, sizes)
    assert max(model.backward, comm) - 1e-12 <= end <= model.backward + comm + 1e-12
