"""What passes plan against: the measured costs of a step (``bucket_cap_mb="auto"``, ``passes/bucket_plan.py``).

A :class:`CostModel` holds when each gradient is ready during the backward, what an all-reduce costs
(``alpha + beta * bytes``), and how much overlapping one slows the backward; :meth:`CostModel.finish`
simulates a bucket plan on it. The runtime measures it once per batch shape, on every rank, and the ranks
agree on one (``transpiler/runtime/cost_probe.py``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

MB = 1024 * 1024


@dataclass(frozen=True)
class CostModel:
    """What the ranks agreed on: all-reduce latency (s) and seconds per byte, each gradient's ready time (s
    from the start of the backward), the backward's duration, and ``contention``: the share of an
    all-reduce's time that overlapping it costs the backward (0 on a GPU whose collectives run on their own
    engines; near 1 on a CPU whose cores are all busy computing)."""

    alpha: float
    beta: float
    ready: dict[str, float]
    backward: float
    contention: float = 0.0

    def all_reduce_seconds(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    def finish(self, buckets: list[list[int]], names: list[str], nbytes: list[int]) -> float:
        """When backward and communication are both done. Buckets are issued in order once the backward has
        produced their last gradient and are reduced one at a time; while an all-reduce runs, the backward
        progresses at ``1 - contention`` of its speed."""
        t = work = free = 0.0
        for bucket in buckets:
            target = min(max(self.ready.get(names[i], self.backward) for i in bucket), self.backward)
            start = max(self._reach(t, work, free, target), free)
            work, t = self._work_at(t, work, free, start), start
            free = start + self.all_reduce_seconds(sum(nbytes[i] for i in bucket))
        return max(free, self._reach(t, work, free, self.backward))

    def _reach(self, t: float, work: float, busy_until: float, target: float) -> float:
        """The time the backward has done ``target`` seconds of work, from ``work`` done at ``t``, with an
        all-reduce running until ``busy_until``."""
        if target <= work:
            return t
        slow = 1.0 - self.contention
        if busy_until > t:
            gained = slow * (busy_until - t)
            if work + gained >= target:
                return t + (target - work) / slow
            t, work = busy_until, work + gained
        return t + target - work

    def _work_at(self, t: float, work: float, busy_until: float, later: float) -> float:
        slowed = max(min(later, busy_until) - t, 0.0)
        return work + (1.0 - self.contention) * slowed + max(later - max(busy_until, t), 0.0)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``seconds = alpha + beta * nbytes``, both kept non-negative."""
    mean_x, mean_y = statistics.fmean(nbytes), statistics.fmean(seconds)
    var = sum((x - mean_x) ** 2 for x in nbytes)
    beta = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(nbytes, seconds)) / var, 0.0) if var else 0.0
    return max(mean_y - beta * mean_x, 0.0), beta


@dataclass(frozen=True)
class LinkCost:
    """What one all-gather of ``n`` bytes costs on the step's group, ``alpha + beta * n`` seconds, as the ranks
    agreed on it (``runtime/cost_probe.py``), and whether the step's collectives can run behind its compute
    (``overlaps``: on a GPU; on the CPU every all-gather runs alone, ``schedule-collectives``). ZeRO-3's gather
    units are sized on it (``bucket_cap_mb="cost"``)."""

    alpha: float
    beta: float
    overlaps: bool

    @property
    def half_bytes(self) -> float:
        """The bytes whose transfer takes as long as starting the collective (``alpha / beta``, Hockney's n½):
        a unit smaller than this spends most of its time on the start, one larger on its bytes."""
        return self.alpha / self.beta if self.beta > 0 else float("inf")
