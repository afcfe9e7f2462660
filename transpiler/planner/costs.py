"""The planner's cost model: a layout's step time, peak memory per rank, bytes per link and steps to the target.

Every layout trains the same global batch, the example batch on each of the cluster's W ranks: a pipeline of
``pp`` stages takes ``pp`` example batches per pipeline, cut into microbatches. The assumptions, one per term
(docs/planner.md says the same):

- **Compute** is the profile's forward, backward and update (``planner/profile.py``). ZeRO updates 1/dp of the
  parameters; recompute adds its share of the forward; a pipeline stage runs 1/pp of the forward and backward per
  microbatch, ``m + pp − 1`` slots of them (1F1B's and GPipe's length; the bubble is the ``pp − 1``).
- **Communication** is each layout's own collectives, by kind and bytes, priced per link level
  (``planner/cluster.py``): all-reduce of the gradient buckets (fused_allreduce); all-to-all of the buckets and
  all-gather of the parameters (zero1, zero2: gloo has no reduce-scatter, docs/memory.md); twice the all-gather
  with ``reshard_after_forward`` (zero3); DiLoCo's all-reduce every H steps; Streaming DiLoCo's int4 fragments,
  overlapped with the inner steps (τ = 1); SparseLoCo's and DeMo's compressed all-gathers; a pipeline's
  activations and their gradients point to point. On the CPU nothing overlaps (gloo's transfers and the compute
  share the cores: ``cost_probe``'s contention is near 1); on a GPU the gradient collectives of data parallelism
  hide behind the backward up to its length.
- **Memory** is what the rank holds by mode (the counts of docs/memory.md with this model's bytes: parameters,
  gradient buckets, optimizer state over dp for ZeRO, the DiLoCo family's global copies) plus the step's own
  tensors at their peak from the schedule (``graph/memory.py``), after recompute where a budget is set, and
  zero3's gathered units.
- **Execution flags** (on a GPU whose programs a calibration measured: ``planner/programs.py``): the compute
  above scaled to the program's step under the flags: as measured, or for compiled and captured the compiled
  program's device time plus a replay's cost; the peak moved by what compiling moved the measured program's;
  the first call's seconds as ``setup``, spread over the run where ``plan(steps=...)`` says how long it is.
- **Steps to the target** are 1 for data-parallel modes (the same arithmetic as one process) and, for the
  low-communication modes, the factors measured on this project's bench (``STEPS_FACTORS``); a user with other
  measurements passes their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from passes.bucketing import assign_buckets, caps_in_bytes
from passes.stage_balance import balance

from .cluster import Cluster
from .profile import StepProfile
from .programs import flags_key, step_seconds
from .tensor_parallel import split_profile

# Steps to DDP's target as a share of DDP's steps, measured by bench/wan.py (GPT of 1.8M parameters, 4 hosts of one
# rank, warm start, constant lr; docs/strategies/low_communication.md): the steps each mode took to DDP's held-out
# loss after 180 steps, checked every 15 steps. A property of that model, data and start.
MEASURED_STEPS_FACTORS = {
    "diloco H=15": 255 / 180,
    "diloco H=50": 210 / 180,
    "streaming_diloco": 165 / 180,
    "sparseloco": 150 / 180,
    "demo": 75 / 180,
}
# What a plan assumes unless told otherwise: the measured factors, but never fewer steps than data parallelism's.
# From that warm start three modes needed fewer (0.42–0.92); taken as a law, they would rank a low-communication
# mode first on any link, a single host's included. ``plan(..., steps_factors=MEASURED_STEPS_FACTORS)`` takes them.
STEPS_FACTORS = {mode: max(factor, 1.0) for mode, factor in MEASURED_STEPS_FACTORS.items()}
# Compute beyond the inner step in units of the optimizer's update (the same bench, the step times there): DeMo's
# DCT and top-k every step, SparseLoCo's compression per sync, Streaming DiLoCo's apply per fragment, DiLoCo's outer
# step per sync.
EXTRA_UPDATES = {"demo": 12.0, "sparseloco": 24.0, "streaming_diloco": 2.7, "diloco": 3.0}
# Bytes each rank contributes to a compressed exchange, per byte of float32 parameters: SparseLoCo's top 128 of each
# 64 × 64 tile at 2 bits plus a 16-bit index, DeMo's top 32 DCT coefficients of each tile in float32 plus an int64
# index (within 30% of what bench/wan.py's link counters saw).
PAYLOAD = {"sparseloco": (128 / 4096) * (2 + 16) / 32, "demo": (32 / 4096) * (32 + 64) / 32}
DATA_PARALLEL = ("fused_allreduce", "zero1", "zero2", "zero3")
LOW_COMMUNICATION = ("diloco", "streaming_diloco", "sparseloco", "demo")


@dataclass(frozen=True)
class Layout:
    """A candidate before it is a config: the mode over ``dp`` ranks, pipeline stages and microbatches, the
    recompute budget and the mode's settings that the planner varies."""

    mode: str
    dp: int
    pp: int = 1
    microbatches: int = 1
    memory_budget: float | None = None
    sync_every: int | None = None
    fragments: int = 4  # Streaming DiLoCo's: at most the modules that hold trainable parameters
    compile: bool = False
    cuda_graph: bool = False
    tp: int = 1  # a tensor-parallel group of tp ranks of one host under the user's plan, the mode over dp of them

    @property
    def label(self) -> str:
        parts = [self.mode if self.mode != "none" else "pipeline"]
        if self.sync_every is not None and self.mode == "diloco":
            parts[0] += f" H={self.sync_every}"
        if self.mode == "streaming_diloco" and self.fragments != 4:
            parts[0] += f" fragments={self.fragments}"
        if self.pp > 1:
            parts.append(f"pp={self.pp}×dp={self.dp} m={self.microbatches}")
        if self.tp > 1:
            parts.append(f"dp={self.dp}×tp={self.tp}")
        if self.memory_budget is not None:
            parts.append("recompute" if self.memory_budget == 0 else f"budget {self.memory_budget:g}")
        parts += [flag for flag, on in (("compiled", self.compile), ("captured", self.cuda_graph)) if on]
        return ", ".join(parts)

    @property
    def factor_key(self) -> str:
        return f"diloco H={self.sync_every}" if self.mode == "diloco" else self.mode


@dataclass(frozen=True)
class Estimate:
    """What a layout is predicted to cost per step: ``compute`` and exposed ``communication`` seconds (averaged
    over a round for the modes that sync every H steps), ``peak`` bytes per rank, ``sent`` bytes per rank per
    step by link level, ``steps_factor``: steps to the target over data parallelism's, and ``setup``: seconds
    once, before the first step (a compile)."""

    compute: float
    communication: float
    peak: int
    sent: dict[str, float] = field(default_factory=dict)
    steps_factor: float = 1.0
    setup: float = 0.0

    @property
    def step(self) -> float:
        return self.compute + self.communication

    @property
    def to_target(self) -> float:
        """Seconds per data-parallel step's worth of progress: the step time times the steps factor."""
        return self.step * self.steps_factor


def estimate(layout: Layout, profile: StepProfile, cluster: Cluster, factors: dict[str, float]) -> Estimate:
    """The cost of ``layout`` on ``cluster`` for the step ``profile`` describes (module docstring)."""
    if not cluster.programs:
        return _estimate(layout, profile, cluster, factors)
    # on a GPU with measured programs: the eager compute rescaled to the program's under the layout's flags
    default = cluster.programs["default"]
    flagged = step_seconds(cluster.programs, layout.compile, layout.cuda_graph)
    if flagged is None:
        raise ValueError(f"{layout.label}: the compiled program was not measured")
    scale = flagged / profile.compute.step
    times = profile.compute
    scaled = dataclasses.replace(
        profile,
        compute=dataclasses.replace(
            times, forward=times.forward * scale, backward=times.backward * scale, update=times.update * scale
        ),
    )
    plain = _estimate(layout, scaled, cluster, factors)
    # the peak moves with the compile only: a captured step's tensors live in its graph's private pool, which the
    # allocator's peak does not count, and which holds what the uncaptured step's peak holds (bench/gpu.py counts
    # the pool whole: 3% over the uncaptured peak on GPT-2)
    moved = cluster.programs["compile"].peak - default.peak if layout.compile else 0
    first = cluster.programs.get(flags_key(layout.compile, layout.cuda_graph))
    return dataclasses.replace(plain, peak=plain.peak + moved, setup=(first or default).first_call)


def _estimate(layout: Layout, profile: StepProfile, cluster: Cluster, factors: dict[str, float]) -> Estimate:
    if layout.pp > 1:
        return _pipeline(layout, profile, cluster)
    if layout.tp > 1:
        return _tensor_parallel(layout, profile, cluster, factors)
    times, grads, dp = profile.compute, profile.parameter_bytes, layout.dp
    level = cluster.level_of(dp)
    compute = times.forward * (1 + _recompute(layout, profile)[1]) + times.backward
    compute += times.update / dp if layout.mode.startswith("zero") else times.update
    peak = _memory(layout, profile, cluster)
    if layout.mode in DATA_PARALLEL:
        seconds = _data_parallel_seconds(layout.mode, _buckets(_sizes(profile)), dp, cluster)
        sent = {level: _data_parallel_sent(layout.mode, grads, dp, cluster)}
        return Estimate(compute, _exposed(seconds, times.backward, cluster), peak, sent)
    every = layout.sync_every or 1
    syncs = {"demo": 1, "streaming_diloco": every / layout.fragments}.get(layout.mode, every)  # steps per sync
    extra = EXTRA_UPDATES[layout.mode] * times.update / syncs
    if layout.mode == "diloco":  # a blocking all-reduce of every parameter each H steps
        seconds = sum(cluster.collective_seconds("all_reduce", b, dp) for b in _buckets(_sizes(profile))) / every
        sent_bytes = 2 * grads * (dp - 1) / dp / every
    elif layout.mode == "streaming_diloco":  # int4 fragments, each exchange behind the next inner step (τ = 1)
        wire = grads / 8  # 4 bits a value (the scales are a few bytes per tensor)
        k = layout.fragments
        fragment = cluster.collective_seconds("all_to_all", wire / k, dp) + cluster.collective_seconds(
            "all_gather", wire / k, dp
        )
        seconds = max(fragment - compute, 0.0) / (every / k)  # what one inner step does not hide, per H/k steps
        sent_bytes = 2 * wire * (dp - 1) / dp / every
    else:  # sparseloco every H steps, demo every step: each rank's compressed payload all-gathered
        payload = grads * PAYLOAD[layout.mode]
        seconds = cluster.collective_seconds("all_gather", payload * dp, dp) / every
        sent_bytes = payload * (dp - 1) / every
    factor = factors.get(layout.factor_key, 1.0)
    return Estimate(compute + extra, seconds, peak, {level: sent_bytes}, factor)


def _tensor_parallel(layout: Layout, profile: StepProfile, cluster: Cluster, factors: dict[str, float]) -> Estimate:
    """The mode over ``dp`` groups of ``tp`` ranks each (planner/tensor_parallel.py): priced as on the profile one
    rank of a group sees, on a cluster whose hosts hold ``ranks_per_host / tp`` groups (a ``dp`` group's ranks are
    one of each), plus the plan's exchanges within the group, which nothing overlaps."""
    tp, shape = layout.tp, profile.tensor_parallel
    groups = dataclasses.replace(cluster, ranks_per_host=cluster.ranks_per_host // tp)
    plain = _estimate(dataclasses.replace(layout, tp=1), split_profile(profile, tp), groups, factors)
    sent, level = dict(plain.sent), cluster.level_of(tp)
    sent[level] = sent.get(level, 0.0) + shape.sent(tp)
    return dataclasses.replace(plain, communication=plain.communication + shape.seconds(cluster, tp), sent=sent)


def _pipeline(layout: Layout, profile: StepProfile, cluster: Cluster) -> Estimate:
    """1F1B over ``pp`` stages of ``m`` microbatches, each pipeline taking ``pp`` example batches: the busiest
    stage's slot is its share of a microbatch's forward and backward, ``m + pp − 1`` slots, each with an activation
    sent forward and its gradient back on the slowest link between stages; the heaviest stage updates its share of
    the parameters, whose gradients its dp group all-reduces, and holds ``min(pp, m)`` microbatches' activations."""
    times, pp, dp, m = profile.compute, layout.pp, layout.dp, layout.microbatches
    slots = m + pp - 1
    message = profile.boundary_bytes * pp / m
    hop = cluster.collective_seconds("p2p", message, 2, contiguous=dp == 1)
    busiest, heaviest = _largest_stage(profile, pp)
    compute = slots * (times.forward + times.backward) * pp * busiest / m + times.update * heaviest
    grads = profile.parameter_bytes * heaviest
    # the stage's parameters are not tracked one by one: its gradients are priced as one run of buckets
    reduce = sum(cluster.collective_seconds("all_reduce", b, dp) for b in _buckets([int(grads)])) if dp > 1 else 0.0
    sent = {cluster.level_of(2, contiguous=dp == 1): 2 * m * message * (pp - 1) / pp}
    if dp > 1:
        level = cluster.level_of(dp)
        sent[level] = sent.get(level, 0.0) + 2 * grads * (dp - 1) / dp
    held = (profile.parameter_bytes * (2 if dp > 1 else 1) + profile.state_bytes) * heaviest + profile.other_bytes / pp
    # after the backward: the gradients summed over the microbatches (the sum, a microbatch's, the new sum: three
    # times the stage's parameters), then the update, in place beside fused_allreduce (its passes reinplace it:
    # temporaries as large as the state) or, with no mode, as traced: new parameters and state, as many temporaries
    update = profile.state_bytes if dp > 1 else 2 * (profile.parameter_bytes + profile.state_bytes)
    update = max(update, 3 * profile.parameter_bytes) * heaviest
    peak = held + profile.batch_bytes * pp + max(profile.transient * pp * busiest * min(pp, m) / m, update)
    return Estimate(compute, 2 * slots * hop + _exposed(reduce, times.backward, cluster), int(peak), sent)


def _recompute(layout: Layout, profile: StepProfile) -> tuple[int, float]:
    """The step's own peak and the added forward share at the layout's budget."""
    if layout.memory_budget is None:
        return profile.transient, 0.0
    level = next(r for r in profile.recompute if r.budget == layout.memory_budget)
    return level.transient, level.extra_forward


def _exposed(seconds: float, backward: float, cluster: Cluster) -> float:
    """Communication on the step's critical path: all of it on the CPU; on a GPU what outlasts the backward."""
    return seconds if cluster.device == "cpu" else max(seconds - backward, 0.0)


def _buckets(sizes: list[int]) -> list[int]:
    """The bytes of each bucket ``fuse-allreduce`` and ZeRO make at their defaults (DDP's caps: 1 MiB, then 25 MiB)
    of gradients of ``sizes`` bytes, given in model order and bucketed in reverse, as the backward makes them."""
    cap, first = caps_in_bytes(25.0, 1.0)
    reverse = sizes[::-1]
    return [sum(reverse[i] for i in bucket) for bucket in assign_buckets(reverse, [()] * len(reverse), cap, first)]


def _sizes(profile: StepProfile) -> list[int]:
    return [size for _, size in profile.parameters]


def _data_parallel_seconds(mode: str, buckets: list[int], dp: int, cluster: Cluster) -> float:
    if mode == "fused_allreduce":
        return sum(cluster.collective_seconds("all_reduce", b, dp) for b in buckets)
    if mode == "zero3" and cluster.device == "cpu":  # one unit of every parameter (_gathers): one of each
        buckets = [sum(buckets)]
    scatter = sum(cluster.collective_seconds("all_to_all", b, dp) for b in buckets)
    return scatter + _gathers(mode, cluster) * sum(cluster.collective_seconds("all_gather", b, dp) for b in buckets)


def _gathers(mode: str, cluster: Cluster) -> int:
    """How often a step all-gathers the parameters: once after the update (zero1, zero2); zero3 on a GPU before
    the forward and again before the backward (``reshard_after_forward``), on the CPU once: its ``cost`` cap makes
    one unit of every parameter there, gathered whole and held through the backward (docs/memory.md)."""
    return 2 if mode == "zero3" and cluster.device != "cpu" else 1


def _data_parallel_sent(mode: str, grads: int, dp: int, cluster: Cluster) -> float:
    return grads * (dp - 1) / dp * (2 if mode == "fused_allreduce" else 1 + _gathers(mode, cluster))


def _largest_stage(profile: StepProfile, pp: int) -> tuple[float, float]:
    """The shares of the busiest stage of the pipeline's balanced cut (the one ``split-stages`` makes, by time):
    of the step's compute, from the forward's time by segment, and of the parameters; 1/pp each where they were
    not measured. A stage's slot lasts its share of a microbatch's step."""
    seconds, held = profile.segment_seconds, profile.segment_bytes
    if len(seconds) < pp or sum(seconds) <= 0 or len(held) != len(seconds) or sum(held) <= 0:
        return 1 / pp, 1 / pp
    cut = balance(seconds, held, pp)
    return max(cut.stage_seconds()) / sum(seconds), max(cut.stage_bytes()) / sum(held)


def _memory(layout: Layout, profile: StepProfile, cluster: Cluster) -> int:
    """Bytes per rank at the step's peak (module docstring)."""
    params, state, dp = profile.parameter_bytes, profile.state_bytes, layout.dp
    # the step's own tensors peak in the forward and backward, or in the update, which runs in place in every
    # mode's program (reinplace-optimizer, flat and foreach updates): temporaries as large as the state it updates,
    # or at a DiLoCo-family sync, the exchanged copy of the parameters and the outer update's temporaries
    update = state / dp if layout.mode.startswith("zero") else state
    sync = 2 * params if layout.mode in LOW_COMMUNICATION and layout.mode != "demo" else 0
    base = profile.other_bytes + profile.batch_bytes + max(_recompute(layout, profile)[0], update, sync)
    gathered = params if cluster.device == "cpu" else 2 * profile.largest_module_bytes  # zero3's units (_gathers)
    held = {
        "fused_allreduce": params * 2 + state,
        "zero1": params * 2 + state / dp,
        "zero2": params + state / dp + max(_buckets(_sizes(profile))),  # a bucket alive until it is sent
        "zero3": (params + state) / dp + gathered + max(_buckets(_sizes(profile))),
        "diloco": params * 3 + state,
        "streaming_diloco": params * 2 + params / layout.fragments + state,  # the global copy, a fragment's
        "sparseloco": params * 3 + state,
        "demo": params * 2 + state,
    }[layout.mode]
    return int(base + held)
