"""Modes: named pass pipelines, and how a mode name or spec becomes a Pipeline."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from passes.adasum import AdaSum, AdaSumGeometry
from passes.allgather_grads import AllGatherGrads
from passes.allreduce_grads import AllReduceGrads
from passes.broadcast_params import BroadcastParams
from passes.diloco_outer_step import DiLoCoOuterStep
from passes.dim_reduce import DimReduce
from passes.flatten_update import FlattenUpdate
from passes.foreach_update import ForeachUpdate
from passes.fuse_allreduce import FuseAllReduce
from passes.gather_params import GatherParams
from passes.local_sgd import LocalSGDAverage
from passes.partial_average import PartialAverage
from passes.registry import PASSES
from passes.reinplace_optimizer import ReinplaceOptimizer
from passes.scale_loss_grad import ScaleLossGrad
from passes.schedule_collectives import ScheduleCollectives
from passes.shard_optimizer import ShardOptimizer
from passes.shard_params import ShardParams
from passes.sparse_allreduce import SparseAllReduce
from transpiler.errors import ConfigurationError
from transpiler.graph.options import OptionSpec, field_options, parse_options
from transpiler.graph.pipeline import Pass, parse_spec
from transpiler.trace.optimizers import TWINS

from .composition import (
    ACCUMULATION,
    CLIPPING,
    FREEZE,
    LOSS_SCALING,
    WRAPPER_OPTIONS,
    Recipe,
    Strategy,
    check_combination,
    compose,
)
from .schedules import DiLoCoSchedule, LocalSGDSchedule, RoundRobinSchedule, StreamingDiLoCoSchedule


@dataclass(frozen=True)
class Mode:
    name: str
    summary: str
    build: Callable[..., Recipe]
    options: dict[str, OptionSpec]

    def strategy(self, **options: Any) -> Strategy:
        """The strategy for these options, each parsed strictly (``ConfigurationError`` names a bad one).

        Defaults come from the option specs, the one place they are written.
        The mode's own options go to its recipe; the wrapping ones
        (accumulation, loss scaling, clipping, freeze) to :func:`compose`.
        """
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ConfigurationError(self._unknown(unknown))
        given = parse_options(self.options, options, f"mode '{self.name}'")
        values = {name: spec.default for name, spec in self.options.items()} | given
        check_combination(self.name, given, values)
        own = {k: v for k, v in values.items() if k not in WRAPPER_OPTIONS}
        return compose(self.build(**own), {k: v for k, v in values.items() if k in WRAPPER_OPTIONS})

    def _unknown(self, names: list[str]) -> str:
        where = []
        for name in names:
            modes = [m.name for m in MODES.values() if name in m.options]
            where.append(f"'{name}' works with {', '.join(modes)}" if modes else f"'{name}' is no option of any mode")
        known = ", ".join(self.options) or "none"
        return (
            f"mode '{self.name}' takes no option(s) {names} ({'; '.join(where)}; see docs/strategies/composition.md). "
            f"Its options: {known}."
        )


def _prefix() -> list[Pass]:
    return [BroadcastParams()]


def _update() -> list[Pass]:
    """The update on flat buffers where it can run there, else as multi-tensor ops per group of parameters."""
    return [FlattenUpdate(), ForeachUpdate()]


def _tail() -> list[Pass]:
    return [*_update(), ScheduleCollectives(), ReinplaceOptimizer()]


def _allreduce() -> Recipe:
    return Recipe({"step": [AllReduceGrads()]}, _prefix(), [ScaleLossGrad()], _tail(), replicated=True)


def _fused(
    bucket_cap_mb: float | str,
    first_bucket_mb: float,
    gradient_as_bucket_view: bool,
    compress: str,
    sparsify: float,
    sparsify_threshold: float,
) -> Recipe:
    if sparsify:
        reduce: Pass = SparseAllReduce(
            ratio=sparsify, threshold=sparsify_threshold, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb
        )
    else:
        reduce = FuseAllReduce(
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            compress=compress,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
    return Recipe({"step": [reduce]}, _prefix(), [ScaleLossGrad()], _tail(), replicated=not sparsify)


def _local_sgd(
    adaptive: bool, k: int, begin_step: int, average_state: bool, cap: float, first: float, compress: str
) -> Recipe:
    average = LocalSGDAverage(
        average_state=average_state, report_loss=adaptive, bucket_cap_mb=cap, first_bucket_mb=first, compress=compress
    )
    return Recipe(  # both variants flat, with the same buffers: the parameters stay bound across variants
        {"local": _update(), "sync": [*_update(), average, ScheduleCollectives()]},
        _prefix(),
        tail=[ReinplaceOptimizer()],
        schedule=lambda: LocalSGDSchedule(k_steps=k, begin_step=begin_step, adaptive=adaptive),
    )


def _plain_local_sgd(k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress) -> Recipe:
    return _local_sgd(False, k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress)


def _adaptive_local_sgd(init_k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress) -> Recipe:
    return _local_sgd(True, init_k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress)


def _diloco(
    sync_every: int,
    replica_size: int,
    replica_mode: str,
    offload_global: bool,
    bucket_cap_mb: float,
    first_bucket_mb: float,
) -> Recipe:
    """H inner steps of the user's optimizer per replica, then the sync (``diloco-outer-step``) after the last.
    With ``replica_size=R`` a replica is R consecutive ranks that train it with data parallel every step
    (``replica_mode``: ``fused_allreduce`` or ZeRO-1/2 across axis ``replica``), and DiLoCo runs across the
    replicas (axis ``across``)."""
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": first_bucket_mb}
    outer = DiLoCoOuterStep(**caps, offload=offload_global, axis="across" if replica_size > 1 else "world")
    body = {"inner": [], "sync": [outer]}
    return _replicas(replica_size, replica_mode, body, caps, DiLoCoSchedule(sync_every), lambda o: None)


def _streaming_diloco(
    sync_every: int,
    fragments: int,
    fragment_sync_delay: int,
    fragment_update_alpha: float,
    exchange_dtype: str,
    replica_size: int,
    replica_mode: str,
    offload_global: bool,
) -> Recipe:
    """DiLoCo with the parameters cut into fragments that sync in turn, each exchange overlapping
    ``fragment_sync_delay`` inner steps (``StreamingDiLoCoSchedule``), in ``exchange_dtype`` on the wire."""
    schedule = StreamingDiLoCoSchedule(sync_every, fragments, fragment_sync_delay)  # checks the options now
    common = {
        "fragments": fragments,
        "alpha": fragment_update_alpha,
        "exchange": exchange_dtype,
        "offload": offload_global,
        "axis": "across" if replica_size > 1 else "world",
    }
    body: dict[str, list[Pass]] = {"inner": []}
    for p in range(fragments):
        phase = "start" if fragment_sync_delay else "whole"
        body[f"sync{p}"] = [DiLoCoOuterStep(fragment=p, phase=phase, **common)]
        if fragment_sync_delay:
            body[f"apply{p}"] = [DiLoCoOuterStep(fragment=p, phase="finish", **common)]
    return _replicas(replica_size, replica_mode, body, {}, schedule, _outer_sgd)


def _replicas(
    size: int,
    inside: str,
    body: dict[str, list[Pass]],
    caps: dict,
    schedule: Any,
    outer: Callable[[torch.optim.Optimizer], None],
) -> Recipe:
    """A DiLoCo recipe: each variant's ``body``, after data parallel inside replicas of ``size`` ranks (none when
    each rank is its own replica), by ``inside``: ``fused_allreduce``, or ZeRO-1/2 over the replica's ranks (the
    inner optimizer's state sharded, the updated parameters gathered whole before the outer step reads them);
    ``schedule`` is copied fresh for every step that asks."""
    seed: list[Pass] = []
    micro_tail: list[Pass] | None = None
    micro_body: list[Pass] | None = None
    checks: dict[str, Callable[[torch.optim.Optimizer], None]] = {}
    if size == 1 and inside != "fused_allreduce":
        raise ConfigurationError(
            f"replica_mode='{inside}' shards each replica's optimizer state over its ranks, and replica_size=1 "
            "makes every rank its own replica: give replica_size=R (R ranks per replica), or drop replica_mode."
        )
    if size > 1:
        seed = [ScaleLossGrad(axis="replica")]
        if inside == "fused_allreduce":
            inner: list[Pass] = [FuseAllReduce(axis="replica", **caps)]
        else:
            stage = int(inside.removeprefix("zero"))
            shard = ShardOptimizer(axis="replica", keep_gradient_buckets=stage == 1, **caps)
            inner = [shard, GatherParams(axis="replica")]
            checks["check"] = _elementwise(f"diloco with replica_mode='{inside}'")
            if stage == 2:  # micro-steps reduce-scatter into this rank's slices, as zero2's
                micro_body, micro_tail = [shard], [ScheduleCollectives()]
        body = {v: [*inner, *passes] for v, passes in body.items()}
    return Recipe(
        body,
        _prefix(),
        seed,
        tail=[ForeachUpdate(), ScheduleCollectives(), ReinplaceOptimizer()],
        schedule=lambda: dataclasses.replace(schedule),
        groups=lambda world: ReplicaLayout(world, size).groups(),
        micro_tail=micro_tail,
        micro_body=micro_body,
        gradient_axis="replica" if size > 1 else "world",
        axes=lambda world, rank: ReplicaLayout(world, size).axes(rank),
        outer=outer,
        **checks,
    )


@dataclass(frozen=True)
class ReplicaLayout:
    """``world`` ranks as replicas of ``size`` consecutive ranks (a host, say): axis ``replica`` is a rank's
    replica, axis ``across`` the ranks that hold the same place in every replica. Size 1: no axes."""

    world: int
    size: int

    def __post_init__(self) -> None:
        if self.world % self.size:
            raise ConfigurationError(
                f"replica_size={self.size} does not divide the world size {self.world}: every replica needs "
                "the same number of ranks."
            )

    def axes(self, rank: int) -> dict[str, tuple[int, ...]]:
        if self.size == 1:
            return {}
        start, place = rank - rank % self.size, rank % self.size
        return {
            "replica": tuple(range(start, start + self.size)),
            "across": tuple(range(place, self.world, self.size)),
        }

    def groups(self) -> list[tuple[int, ...]]:
        """Every replica's group, then every ``across`` group, in one order for every rank."""
        if self.size == 1:
            return []
        replicas = [tuple(range(s, s + self.size)) for s in range(0, self.world, self.size)]
        return replicas + [tuple(range(place, self.world, self.size)) for place in range(self.size)]


def _outer_sgd(outer: torch.optim.Optimizer) -> None:
    """Streaming DiLoCo steps each fragment's parameters at its own step: an outer optimizer that keeps one step
    count per param group (Adam's bias correction) would see counts that disagree."""
    if type(outer) is not torch.optim.SGD:
        raise ConfigurationError(
            f"mode 'streaming_diloco' updates one fragment's global weights at a time, so its outer optimizer must "
            f"keep no step count per param group; {type(outer).__name__} does. Use torch.optim.SGD (the paper's "
            "outer optimizer is SGD with Nesterov momentum), or mode 'diloco'."
        )


def _adasum(target: str) -> Callable[..., Recipe]:
    def build(local_size: int) -> Recipe:
        return Recipe(
            {"step": [AdaSum(target=target, local_size=local_size)]},
            _prefix(),
            tail=[*_update(), ReinplaceOptimizer()],
            groups=lambda world: AdaSumGeometry(world, local_size).groups(),
        )

    return build


def _allgather(bucket_cap_mb: float, first_bucket_mb: float) -> Recipe:
    gather = AllGatherGrads(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    return Recipe({"step": [gather]}, _prefix(), [ScaleLossGrad()], _tail(), check=_twin_only)


def _twin_only(optimizer: torch.optim.Optimizer) -> None:
    """The all-gather mode copies the optimizer's update once per rank's gradient: it needs a functional twin."""
    if type(optimizer) not in TWINS:
        raise ConfigurationError(
            f"mode 'allgather' applies the optimizer once per rank's gradient, by copying its functional twin; "
            f"{type(optimizer).__name__} has none (only torch.optim.SGD, Adam and AdamW do). Use another mode, "
            "or one of those optimizers."
        )


def _zero(stage: int) -> Callable[..., Recipe]:
    def build(bucket_cap_mb: float | str, first_bucket_mb: float, reshard_after_forward: bool = True) -> Recipe:
        shard = ShardOptimizer(
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            keep_gradient_buckets=stage == 1,
            module_buckets=stage == 3,  # ZeRO-3 gathers by bucket: a layer's parameters in one
        )
        # after loss scaling and clipping, which run on the slices: one update per bucket on this rank's flat shard,
        # then the updated shards gathered (ZeRO-1, 2); or keep the slices and gather the parameters where the
        # forward and backward read them, the update per parameter (ZeRO-3 holds parameters as slices)
        shard_params = ShardParams(reshard_after_forward=reshard_after_forward)
        gather = [shard_params] if stage == 3 else [*_update(), GatherParams()]
        tail = [*gather, ScheduleCollectives(), ReinplaceOptimizer()]
        # ZeRO-1 accumulates whole gradients (no communication in a micro-step, as DDP's no_sync); ZeRO-2/3
        # reduce-scatter every micro-step into accumulators of this rank's slices, as DeepSpeed's stage 2
        micro = None if stage == 1 else ([shard_params] if stage == 3 else []) + [ScheduleCollectives()]
        check = _elementwise(f"zero{stage}")
        return Recipe(
            {"step": [shard]}, _prefix(), [ScaleLossGrad()], tail, check=check, replicated=True, micro_tail=micro
        )

    return build


# optimizers whose update needs whole tensors, which a sharded mode refuses at transpile() (their names, since
# not every torch has them); a user's own optimizer is checked op by op when the step is built
WHOLE_TENSOR = {
    "Adafactor": "its factored second moment averages every row and column of a matrix",
    "Muon": "it orthogonalises every whole matrix (Newton-Schulz iterations)",
}


def _elementwise(mode: str) -> Callable[[torch.optim.Optimizer], None]:
    def check(optimizer: torch.optim.Optimizer) -> None:
        for member in getattr(optimizer, "members", [optimizer]):
            why = next((why for name, why in WHOLE_TENSOR.items() if type(member).__name__ == name), None)
            if why is not None:
                raise ConfigurationError(
                    f"mode '{mode}' updates each rank's slice of every parameter, so the optimizer must be "
                    f"element-wise; {type(member).__name__} is not: {why}. Use fused_allreduce, or put the matrices "
                    "that need it in fused_allreduce and the rest in an element-wise optimizer."
                )

    return check


def _partial_sync(partitions: int, bucket_cap_mb: float, first_bucket_mb: float) -> Recipe:
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": first_bucket_mb}
    return Recipe(
        {
            f"sync{i}": [PartialAverage(partitions=partitions, index=i, **caps), ScheduleCollectives()]
            for i in range(partitions)
        },
        _prefix(),
        tail=[ReinplaceOptimizer()],
        schedule=lambda: RoundRobinSchedule(partitions),
    )


def _dim_reduce(
    pca_path: str,
    n_components: int,
    rho: float,
    gamma: float,
    alpha: float,
    sigma: float,
    bucket_cap_mb: float,
    first_bucket_mb: float,
) -> Recipe:
    reduce = FuseAllReduce(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    step = DimReduce(pca_path=pca_path, n_components=n_components, rho=rho, gamma=gamma, alpha=alpha, sigma=sigma)

    def check(optimizer: torch.optim.Optimizer) -> None:
        """At transpile(), before anything is traced: the basis file and the optimizer."""
        step.rows()
        _plain_sgd(optimizer)

    return Recipe({"step": [reduce, step]}, _prefix(), [ScaleLossGrad()], _tail(), check=check)


def _plain_sgd(optimizer: torch.optim.Optimizer) -> None:
    """DimReduce's update is Boost's ``SGD(learning_rate=1)``: the user's SGD without momentum or decay."""
    bad = [
        f"group {i}: {key}={group.get(key)!r}"
        for i, group in enumerate(optimizer.param_groups)
        for key in ("momentum", "weight_decay", "nesterov", "maximize")
        if group.get(key)
    ]
    if type(optimizer) is not torch.optim.SGD or bad:
        got = type(optimizer).__name__ + (f" with {', '.join(bad)}" if bad else "")
        raise ConfigurationError(
            f"mode 'dim_reduce' applies its own update through plain SGD, as MindSpore Boost swaps in "
            f"SGD(learning_rate=1); got {got}. Use torch.optim.SGD(params, lr=1.0) (lr scales every step DimReduce "
            "takes, trials included; momentum and weight decay would act on the line-search trials)."
        )


def own_options(cls: type[Pass]) -> dict[str, OptionSpec]:
    """A pass's own options, without those every pass has (``axis``), which a mode sets itself."""
    common = field_options(Pass)
    return {name: spec for name, spec in field_options(cls).items() if name not in common}


BUCKET_OPTIONS = {name: field_options(LocalSGDAverage)[name] for name in ("bucket_cap_mb", "first_bucket_mb")}
FUSED_OPTIONS = {  # bucket_cap_mb takes "auto" here
    name: field_options(FuseAllReduce)[name] for name in ("bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view")
}
ZERO3_BUCKETS = {  # bucket_cap_mb takes "layer" here, its default: about one layer gathered at a time
    "bucket_cap_mb": dataclasses.replace(field_options(ShardOptimizer)["bucket_cap_mb"], default="layer"),
    "first_bucket_mb": BUCKET_OPTIONS["first_bucket_mb"],
}
COMPRESS = {"compress": field_options(FuseAllReduce)["compress"]}
SPARSIFY = {
    "sparsify": OptionSpec(float, 0.0, minimum=0, maximum=1, help="send this share of each bucket, top-K (0: off)"),
    "sparsify_threshold": field_options(SparseAllReduce)["threshold"],
}
LOCAL_SGD_OPTIONS = {
    "begin_step": OptionSpec(int, 1, minimum=0, help="steps 1..begin_step all synchronise (warm-up)"),
    "average_state": field_options(LocalSGDAverage)["average_state"],
    **BUCKET_OPTIONS,
    **COMPRESS,
    **ACCUMULATION,
}
LOCAL_SIZE = {"local_size": field_options(AdaSum)["local_size"]}
REPLICA_SIZE = {
    "replica_size": OptionSpec(int, 1, minimum=1, help="ranks per replica, data parallel inside it (HSDP's layout)"),
    "replica_mode": OptionSpec(
        str,
        "fused_allreduce",
        choices=("fused_allreduce", "zero1", "zero2"),
        help="data parallel inside a replica: gradients all-reduced, or the optimizer state sharded (ZeRO-1/2)",
    ),
}
OFFLOAD = {"offload_global": field_options(DiLoCoOuterStep)["offload"]}
GRADIENT_WRAPPERS = {**ACCUMULATION, **LOSS_SCALING, **CLIPPING, **FREEZE}

MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("none", "no passes: the traced single-process step as it is", lambda: Recipe({"step": []}), {}),
        Mode(
            "allreduce",
            "Paddle GradAllReduce: scale the loss grad, one all-reduce per gradient",
            _allreduce,
            GRADIENT_WRAPPERS,
        ),
        Mode(
            "fused_allreduce",
            "like allreduce, with gradients coalesced into dtype/size buckets (DDP-style caps)",
            _fused,
            {**FUSED_OPTIONS, **COMPRESS, **SPARSIFY, **GRADIENT_WRAPPERS},
        ),
        Mode(
            "local_sgd",
            "Paddle LocalSGD: local steps, parameters averaged through snapshot deltas every k_steps",
            _plain_local_sgd,
            {"k_steps": OptionSpec(int, 1, minimum=1, help="synchronise every k steps"), **LOCAL_SGD_OPTIONS},
        ),
        Mode(
            "adaptive_local_sgd",
            "LocalSGD whose k follows Paddle's rule sqrt(lr_0*loss/(lr*loss_0)*init_k), clipped to [1, 16]",
            _adaptive_local_sgd,
            {"init_k_steps": OptionSpec(int, 1, minimum=1, help="k at the start, then adapted"), **LOCAL_SGD_OPTIONS},
        ),
        Mode(
            "diloco",
            "DiLoCo: H local steps of the inner optimizer, then an outer optimizer on the averaged pseudo-gradients",
            _diloco,
            {
                "sync_every": OptionSpec(int, 100, minimum=1, help="inner steps per outer round (H)"),
                **REPLICA_SIZE,
                **OFFLOAD,
                **BUCKET_OPTIONS,
                **ACCUMULATION,
                **CLIPPING,
            },
        ),
        Mode(
            "streaming_diloco",
            "Streaming DiLoCo: fragments sync in turn, each exchange overlapping inner steps, low-precision wire",
            _streaming_diloco,
            {
                "sync_every": OptionSpec(int, 100, minimum=1, help="inner steps between two syncs of a fragment (H)"),
                "fragments": OptionSpec(int, 4, minimum=1, help="fragments of whole modules, balanced by size (P)"),
                "fragment_sync_delay": OptionSpec(
                    int, 0, minimum=0, help="inner steps between starting a fragment's exchange and applying it (τ)"
                ),
                "fragment_update_alpha": OptionSpec(
                    float, 0.0, minimum=0, maximum=1, help="keep alpha * local + (1 - alpha) * global at a sync"
                ),
                "exchange_dtype": field_options(DiLoCoOuterStep)["exchange"],
                **REPLICA_SIZE,
                **OFFLOAD,
                **ACCUMULATION,
                **CLIPPING,
            },
        ),
        Mode(
            "adasum",
            "AdaSum of gradients (recursive halving, point-to-point exchanges), then the optimizer",
            _adasum("grads"),
            {**LOCAL_SIZE, **ACCUMULATION, **LOSS_SCALING},
        ),
        Mode(
            "adasum_delta",
            "local optimizer step, then AdaSum of the weight deltas (MindSpore AdaSumByDeltaWeight)",
            _adasum("deltas"),
            LOCAL_SIZE,
        ),
        Mode(
            "allgather",
            "Paddle MultiThread all-gather: gather every rank's gradients, apply the optimizer once per gradient",
            _allgather,
            BUCKET_OPTIONS,
        ),
        Mode(
            "dim_reduce",
            "MindSpore Boost DimReduce: averaged gradients, BFGS step in a PCA subspace with line search",
            _dim_reduce,
            {**own_options(DimReduce), **BUCKET_OPTIONS},
        ),
        Mode(
            "zero1",
            "ZeRO-1: reduce-scatter gradient buckets, update this rank's shard of the optimizer state, all-gather",
            _zero(1),
            {**BUCKET_OPTIONS, **ACCUMULATION, **LOSS_SCALING, **CLIPPING},
        ),
        Mode(
            "zero2",
            "ZeRO-2: as zero1, and a gradient bucket lives only until it is reduce-scattered",
            _zero(2),
            {**BUCKET_OPTIONS, **ACCUMULATION, **LOSS_SCALING, **CLIPPING},
        ),
        Mode(
            "zero3",
            "ZeRO-3 (fully sharded): as zero2, and parameters are held as shards, all-gathered where used",
            _zero(3),
            {**ZERO3_BUCKETS, **ACCUMULATION, **LOSS_SCALING, **CLIPPING, **own_options(ShardParams)},
        ),
        Mode(
            "partial_sync",
            "SINGA partial update: local updates every step, one partition of the parameters averaged per step",
            _partial_sync,
            {"partitions": field_options(PartialAverage)["partitions"], **BUCKET_OPTIONS},
        ),
    )
}


def build_passes(mode: str, options: dict[str, Any]) -> list[Pass]:
    """Passes for a single-variant mode name with its options, or for an explicit pipeline spec."""
    variants = build_strategy(mode, options).variants
    if list(variants) != ["step"]:
        raise ConfigurationError(f"mode '{mode}' has several program variants ({', '.join(variants)}).")
    return variants["step"]


def build_strategy(mode: str, options: dict[str, Any]) -> Strategy:
    """The strategy for a mode name with its options, or for an explicit pipeline spec."""
    if not isinstance(mode, str):
        raise ConfigurationError(f"mode must be a mode name or a pipeline spec (a str), got {type(mode).__name__}.")
    if mode in MODES:
        return MODES[mode].strategy(**options)
    if options:
        raise ConfigurationError(
            f"options {sorted(options)} only apply to named modes; put pass options in the spec, "
            "e.g. 'fuse-allreduce{bucket-cap-mb=4}'."
        )
    if not any(c in mode for c in ",{") and mode not in PASSES:
        raise ConfigurationError(
            f"unknown mode '{mode}'. Modes: {', '.join(MODES)}; or give a pipeline spec of passes "
            f"({', '.join(PASSES)}), e.g. 'scale-loss-grad,allreduce-grads'."
        )
    return Strategy({"step": parse_spec(mode, PASSES)})
