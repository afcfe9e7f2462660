"""Modes: named pass pipelines, and how a mode name or spec becomes a Pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from passes import PASSES
from passes.adasum import AdaSum, AdaSumGeometry
from passes.allreduce_grads import AllReduceGrads
from passes.broadcast_params import BroadcastParams
from passes.fuse_allreduce import FuseAllReduce
from passes.local_sgd import LocalSGDAverage
from passes.reinplace_optimizer import ReinplaceOptimizer
from passes.scale_loss_grad import ScaleLossGrad
from passes.schedule_collectives import ScheduleCollectives

from .errors import ConfigurationError
from .options import OptionSpec, field_options, parse_options
from .pipeline import Pass, parse_spec
from .schedules import EveryStep, LocalSGDSchedule


@dataclass(frozen=True)
class Strategy:
    """What a mode builds: a pass list per program variant, and the schedule choosing between them."""

    variants: dict[str, list[Pass]]
    schedule: Callable[[], Any] = EveryStep
    groups: Callable[[int], list[tuple[int, ...]]] = lambda world: []  # rank subsets to create as process groups


@dataclass(frozen=True)
class Mode:
    name: str
    summary: str
    build: Callable[..., list[Pass] | Strategy]
    options: dict[str, OptionSpec]

    def strategy(self, **options: Any) -> Strategy:
        """The strategy for these options, each parsed strictly (``ConfigurationError`` names a bad one).

        Defaults come from the option specs, the one place they are written.
        """
        values = {name: spec.default for name, spec in self.options.items()}
        values.update(parse_options(self.options, options, f"mode '{self.name}'"))
        built = self.build(**values)
        return built if isinstance(built, Strategy) else Strategy({"step": built})


def _allreduce() -> list[Pass]:
    return [BroadcastParams(), ScaleLossGrad(), AllReduceGrads(), ScheduleCollectives(), ReinplaceOptimizer()]


def _fused(bucket_cap_mb: float, first_bucket_mb: float) -> list[Pass]:
    return [
        BroadcastParams(),
        ScaleLossGrad(),
        FuseAllReduce(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb),
        ScheduleCollectives(),
        ReinplaceOptimizer(),
    ]


def _local_sgd(adaptive: bool, k: int, begin_step: int, average_state: bool, cap: float, first: float) -> Strategy:
    average = LocalSGDAverage(
        average_state=average_state, report_loss=adaptive, bucket_cap_mb=cap, first_bucket_mb=first
    )
    return Strategy(
        {
            "local": [BroadcastParams(), ReinplaceOptimizer()],
            "sync": [BroadcastParams(), average, ScheduleCollectives(), ReinplaceOptimizer()],
        },
        lambda: LocalSGDSchedule(k_steps=k, begin_step=begin_step, adaptive=adaptive),
    )


def _plain_local_sgd(k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb) -> Strategy:
    return _local_sgd(False, k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb)


def _adaptive_local_sgd(init_k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb) -> Strategy:
    return _local_sgd(True, init_k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb)


def _adasum(target: str) -> Callable[..., Strategy]:
    def build(local_size: int) -> Strategy:
        return Strategy(
            {"step": [BroadcastParams(), AdaSum(target=target, local_size=local_size), ReinplaceOptimizer()]},
            groups=lambda world: AdaSumGeometry(world, local_size).groups(),
        )

    return build


BUCKET_OPTIONS = {name: field_options(FuseAllReduce)[name] for name in ("bucket_cap_mb", "first_bucket_mb")}
LOCAL_SGD_OPTIONS = {
    "begin_step": OptionSpec(int, 1, minimum=0, help="steps 1..begin_step all synchronise (warm-up)"),
    "average_state": field_options(LocalSGDAverage)["average_state"],
    **BUCKET_OPTIONS,
}
LOCAL_SIZE = {"local_size": field_options(AdaSum)["local_size"]}

MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("none", "no passes: the traced single-process step as it is", lambda: [], {}),
        Mode("allreduce", "Paddle GradAllReduce: scale the loss grad, one all-reduce per gradient", _allreduce, {}),
        Mode(
            "fused_allreduce",
            "like allreduce, with gradients coalesced into dtype/size buckets (DDP-style caps)",
            _fused,
            BUCKET_OPTIONS,
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
            "adasum",
            "AdaSum of gradients (recursive halving, point-to-point exchanges), then the optimizer",
            _adasum("grads"),
            LOCAL_SIZE,
        ),
        Mode(
            "adasum_delta",
            "local optimizer step, then AdaSum of the weight deltas (MindSpore AdaSumByDeltaWeight)",
            _adasum("deltas"),
            LOCAL_SIZE,
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
