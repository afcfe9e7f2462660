"""``plan()``: every layout of the space priced on the cost model, the ones over the memory per rank or refused left
out with the reason, the rest ranked.

The space is small (tens of layouts at a few hosts: ``planner/candidates.py``), so the search is exhaustive, memory
first: a layout over the budget is never ranked, whatever its time. Each estimate is arithmetic on one profile of
the step (``planner/profile.py``), so planning costs one trace, the recompute pass at each budget and, without a
calibration, seven timed eager steps; nothing runs distributed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from transpiler.errors import ConfigurationError
from transpiler.trace.optimizers import as_optimizer

from .candidates import Candidate, Rejected, config_of, layouts, refusal
from .cluster import MIB, Cluster
from .costs import STEPS_FACTORS, Estimate, estimate
from .profile import StepProfile, profile_step

OBJECTIVES = ("time_to_target", "step_time")


@dataclass(frozen=True)
class Plan:
    """The candidates that fit, best first, and those left out with why; the profile and cluster they were priced
    on, the objective, and how long planning took."""

    ranked: list[Candidate]
    rejected: list[Rejected]
    profile: StepProfile
    cluster: Cluster
    objective: str
    seconds: float = 0.0
    factors: Mapping[str, float] = field(default_factory=dict)
    steps: int | None = None

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            over = [r for r in self.rejected if r.estimate is not None]
            if over:
                least = min(over, key=lambda r: r.estimate.peak)
                raise ConfigurationError(
                    f"no layout fits in {self.cluster.memory_per_rank / MIB:,.1f} MiB per rank: the least any needs "
                    f"is {least.estimate.peak / MIB:,.1f} MiB ({least.label}). Give the ranks more memory, a smaller "
                    "batch, or more ranks."
                )
            raise ConfigurationError("no layout can run: " + "; ".join(f"{r.label}: {r.reason}" for r in self.rejected))
        return self.ranked[0]

    def score(self, candidate: Candidate) -> float:
        return score(candidate.estimate, self.objective, self.steps)

    def table(self) -> str:
        """The ranked candidates and the rejected ones as text (``transpiler plan``)."""
        best = self.score(self.ranked[0]) if self.ranked else 0.0
        head = (
            f"# {self.cluster.hosts} host(s) × {self.cluster.ranks_per_host} rank(s), {self.cluster.device}, "
            f"{self.cluster.memory_per_rank / MIB:,.1f} MiB per rank; {len(self.profile.parameters)} trainable "
            f"tensors, {self.profile.parameter_bytes / MIB:,.2f} MiB; ranked by {self.objective.replace('_', ' ')}; "
            f"planned in {self.seconds:.1f} s"
        )
        setup = any(c.estimate.setup for c in self.ranked)  # a column only where a flag costs a first call
        rows = [
            "| # | candidate | step (ms) | compute | communication | steps × | × best | peak (MiB) | sent/step (MiB) |"
            + (" setup (s) |" if setup else ""),
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if setup else ""),
        ]
        for i, c in enumerate(self.ranked, 1):
            e = c.estimate
            sent = ", ".join(f"{level} {b / MIB:,.2f}" for level, b in e.sent.items()) or "0"
            rows.append(
                f"| {i} | {c.label} | {e.step * 1e3:,.1f} | {e.compute * 1e3:,.1f} | {e.communication * 1e3:,.1f} | "
                f"{e.steps_factor:.2f} | {self.score(c) / best:.2f} | {e.peak / MIB:,.1f} | {sent} |"
                + (f" {e.setup:,.1f} |" if setup else "")
            )
        rejected = [f"- {r.label}: {r.reason}" for r in self.rejected]
        return "\n".join([head, "", *rows, "", "Left out:" if rejected else "", *rejected]).rstrip() + "\n"

    def to_dict(self) -> dict[str, Any]:
        def one(c: Candidate) -> dict[str, Any]:
            e = c.estimate
            return {
                "label": c.label,
                "config": c.config.to_dict(),
                "pipeline": c.pipeline.to_dict() if c.pipeline is not None else None,
                "memory_budget": c.layout.memory_budget,
                "execution": c.execution.to_dict(),
                "setup_seconds": e.setup,
                "step_seconds": e.step,
                "compute_seconds": e.compute,
                "communication_seconds": e.communication,
                "steps_factor": e.steps_factor,
                "peak_bytes": e.peak,
                "sent_bytes": e.sent,
            }

        return {
            "objective": self.objective,
            "cluster": self.cluster.to_dict(),
            "ranked": [one(c) for c in self.ranked],
            "rejected": [{"label": r.label, "reason": r.reason} for r in self.rejected],
            "seconds": self.seconds,
            "steps": self.steps,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    example_batch: tuple,
    cluster: Cluster,
    *,
    objective: str = "time_to_target",
    steps_factors: Mapping[str, float] | None = None,
    profile: StepProfile | None = None,
    steps: int | None = None,
    tp_plan: dict | None = None,
) -> Plan:
    """Rank the layouts for this step on ``cluster``. ``example_batch`` is one rank's batch, as ``transpile()``
    takes it; every layout trains W of them per step. ``objective``: ``"time_to_target"`` (step time × the steps
    to the same loss, data parallelism's being 1) or ``"step_time"``. ``steps_factors`` overrides the defaults
    (``planner/costs.py``'s ``STEPS_FACTORS``: the ones bench/wan.py measured, none below 1; keys as there;
    ``MEASURED_STEPS_FACTORS`` as measured). ``profile``: one taken before (a test's, or
    a sweep's), else taken now, with the cluster's measured compute where it has one. ``steps``: how many steps the
    run will take, where known: a layout's one-time cost (a compile) is then spread over them. ``tp_plan``: the
    model's tensor-parallel plan, the dict ``parallelize_module`` takes; with it the plan also weighs tensor-parallel
    degrees within a host (``Candidate.apply_tensor_parallel`` applies a pick's)."""
    if objective not in OBJECTIVES:
        raise ConfigurationError(f"objective is one of {OBJECTIVES}, got {objective!r}.")
    factors = {**STEPS_FACTORS, **(steps_factors or {})}
    unknown = set(factors) - set(STEPS_FACTORS)
    if unknown:
        raise ConfigurationError(f"steps_factors has unknown keys {sorted(unknown)}; known: {sorted(STEPS_FACTORS)}.")
    if steps is not None and steps < 1:
        raise ConfigurationError(f"steps is the run's length, at least 1; got {steps}.")
    start = time.perf_counter()
    profile = profile or agreed(
        lambda: profile_step(model, optimizer, loss_fn, tuple(example_batch), cluster.compute, tp_plan=tp_plan)
    )
    return rank(profile, cluster, as_optimizer(optimizer), objective, factors, start, steps)


def agreed(take: Callable[[], StepProfile]) -> StepProfile:
    """The profile, taken once: under torch.distributed rank 0 takes it and every rank gets rank 0's, so that every
    rank ranks the same candidates in the same order (times measured on each rank would differ, and so could the
    picks, and ranks building different steps would wait on each other forever)."""
    if not (dist.is_available() and dist.is_initialized()):
        return take()
    shared = [take() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def rank(
    profile: StepProfile,
    cluster: Cluster,
    optimizer,
    objective: str,
    factors: Mapping[str, float],
    start: float,
    steps: int | None = None,
) -> Plan:
    """The plan from a profile: price every layout, leave out the refused and those over memory, sort the rest."""
    space, rejected = layouts(profile, cluster)
    fitting: list[Candidate] = []
    for layout in space:
        config, pipeline = config_of(layout)
        why = refusal(layout, config, pipeline, optimizer)
        if why is not None:
            rejected.append(Rejected(layout.label, f"refused: {why}"))
            continue
        cost = estimate(layout, profile, cluster, dict(factors))
        if cost.peak > cluster.memory_per_rank:
            rejected.append(
                Rejected(
                    layout.label,
                    f"over memory: {cost.peak / MIB:,.1f} MiB per rank, the rank has "
                    f"{cluster.memory_per_rank / MIB:,.1f}",
                    cost,
                )
            )
            continue
        fitting.append(Candidate(layout, cost, config, pipeline))
    fitting.sort(key=lambda c: score(c.estimate, objective, steps))
    return Plan(fitting, rejected, profile, cluster, objective, time.perf_counter() - start, factors, steps)


def score(estimate: Estimate, objective: str, steps: int | None = None) -> float:
    """What the objective ranks by: the time to the target (step × steps factor) or the step alone, with the
    one-time setup spread over ``steps`` where the run's length is known (else left out: a long run)."""
    per_step = estimate.to_target if objective == "time_to_target" else estimate.step
    return per_step + (estimate.setup / steps if steps else 0.0)
