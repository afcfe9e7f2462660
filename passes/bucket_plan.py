"""Bucket caps from the measured cost model (``bucket-cap-mb=auto``). Not a pass: ``fuse-allreduce`` asks it.

Each candidate pair of caps (first bucket no larger than the rest) is planned as ``assign_buckets`` plans
it and simulated on :class:`~transpiler.cost_model.CostModel`: a bucket is issued when its last gradient is
ready, all-reduces run one at a time on one channel, what overlaps the backward slows it by the measured
contention, and the plan whose backward and communication end first wins;
among plans within 2% of the best, the one with the fewest buckets (fewer collectives, less to go wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.graph.cost_model import MB, CostModel

from .bucketing import assign_buckets

CANDIDATE_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0, 256.0)
NEAR_TIE = 1.02


@dataclass(frozen=True)
class CapChoice:
    """The caps picked, the predicted end of backward and communication for them and for DDP's defaults."""

    bucket_cap_mb: float
    first_bucket_mb: float
    buckets: int
    predicted_s: float
    default_predicted_s: float
    default_buckets: int
    contention: float

    def describe(self) -> str:
        return (
            f"bucket_cap_mb=auto chose {self.bucket_cap_mb:g} MiB (first {self.first_bucket_mb:g} MiB), "
            f"{self.buckets} buckets; backward and communication predicted to end {self.predicted_s * 1e3:.2f} ms "
            f"after the backward starts, against {self.default_predicted_s * 1e3:.2f} ms and "
            f"{self.default_buckets} buckets with the defaults (25 MiB, first 1 MiB); measured contention "
            f"{self.contention:.2f}"
        )


def choose_caps(model: CostModel, names: list[str], nbytes: list[int], keys: list[tuple]) -> CapChoice:
    """The candidate caps (first bucket no larger than the rest) whose plan finishes communicating first."""

    def plan(cap: float, first: float) -> tuple[float, int]:
        buckets = assign_buckets(nbytes, keys, int(cap * MB), int(first * MB))
        return model.finish(buckets, names, nbytes), len(buckets)

    scored = [(plan(cap, first), cap, first) for cap in CANDIDATE_MB for first in CANDIDATE_MB if first <= cap]
    best = min(t for (t, _), _, _ in scored)
    (t, n), cap, first = min((s for s in scored if s[0][0] <= best * NEAR_TIE), key=lambda s: (s[0][1], s[0][0], -s[1]))
    default_t, default_n = plan(25.0, 1.0)
    return CapChoice(cap, first, n, t, default_t, default_n, model.contention)
