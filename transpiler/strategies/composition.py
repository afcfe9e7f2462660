"""Strategies that wrap any mode's pipeline: accumulation, loss scaling, clipping, gradient freeze.

A mode describes its pipeline as a :class:`Recipe` in parts; :func:`compose`
weaves the wrapping strategies in at fixed places, so each combination is
one well-defined pipeline per program variant:

``prefix  [freeze-groups]  seed  [accumulate-grads]  body  [loss-scale]  [clip-grad-norm]  tail``

Accumulation micro-steps run ``prefix [freeze] seed accumulate-grads{apply=false}
[loss-scale{apply=false}]`` (no body: nothing is reduced or updated). A recipe with a ``micro_tail`` (ZeRO-2
and ZeRO-3) reduces every micro-step and accumulates this rank's reduced slices instead: ``... seed body
accumulate-grads{reduced=true} ...``, micro-steps ending with the ``micro_tail``. Which
options compose with which mode is the table in ``docs/strategies/composition.md``,
built from :data:`WRAPPER_OPTIONS` and each mode's option list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from passes.accumulate_grads import AccumulateGrads
from passes.clip_grad_norm import ClipGradNorm
from passes.freeze_groups import FreezeGroups
from passes.loss_scale import LossScale
from transpiler.errors import ConfigurationError
from transpiler.graph.options import OptionSpec, field_options
from transpiler.graph.pipeline import Pass

from .schedules import ACCUMULATE, AccumulationSchedule, EveryStep, FreezeSchedule


@dataclass(frozen=True)
class Strategy:
    """What a mode builds: a pass list per program variant, and the schedule choosing between them."""

    variants: dict[str, list[Pass]]
    schedule: Callable[[], Any] = EveryStep
    groups: Callable[[int], list[tuple[int, ...]]] = lambda world: []  # rank subsets to create as process groups
    check: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None  # at transpile(): optimizer, files
    replicated: bool = False  # after every update all ranks hold the same model and optimizer (or its slices)
    # set: the mode applies an outer optimizer (DiLoCo), which transpile() traces beside the step; this checks it
    outer: Callable[[torch.optim.Optimizer], None] | None = None
    # a 2-D layout: (world size, rank) -> each axis's ranks that this rank shares it with (groups() holds them all)
    axes: Callable[[int, int], dict[str, tuple[int, ...]]] = lambda world, rank: {}


@dataclass(frozen=True)
class Recipe:
    """A mode's pipeline in parts, so wrapping strategies can be woven in (see the module docstring)."""

    body: dict[str, list[Pass]]  # per variant: the mode's own passes (reduction, averaging)
    prefix: list[Pass] = field(default_factory=list)  # startup (broadcast-params)
    seed: list[Pass] = field(default_factory=list)  # passes that only scale the loss gradient
    tail: list[Pass] = field(default_factory=list)  # after everything (reinplace-optimizer)
    schedule: Callable[[], Any] = EveryStep
    groups: Callable[[int], list[tuple[int, ...]]] = lambda world: []
    check: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None
    replicated: bool = False  # see Strategy; what a resharding checkpoint (save_checkpoint) needs
    # set: an accumulation micro-step runs the body too and accumulates its reduced gradients (this rank's
    # slices, ZeRO-2/3), then these passes in place of the tail; unset: micro-steps accumulate raw gradients
    micro_tail: list[Pass] | None = None
    micro_body: list[Pass] | None = None  # what a sharded recipe's micro-step runs, when not ``body["step"]``
    gradient_axis: str = "world"  # the ranks that share a gradient: loss scaling and clipping work across them
    outer: Callable[[torch.optim.Optimizer], None] | None = None  # see Strategy
    axes: Callable[[int, int], dict[str, tuple[int, ...]]] = lambda world, rank: {}  # see Strategy


_scale = field_options(LossScale)
_clip = field_options(ClipGradNorm)
ACCUMULATION = {"accumulate_steps": OptionSpec(int, 1, minimum=1, help="micro-steps per optimizer update (1: off)")}
LOSS_SCALING = {
    "loss_scale": OptionSpec(
        float,
        "off",
        minimum=1e-30,
        words=(("dynamic", "dynamic"), ("off", "off")),
        help="'dynamic' (GradScaler's rule), a fixed scale, or 'off'",
    ),
    **{name: _scale[name] for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")},
    "min_scale": _scale["min_scale"],
}
CLIPPING = {
    "max_grad_norm": OptionSpec(float, 0.0, minimum=0, help="clip the reduced gradients to this global norm (0: off)"),
    "norm_type": _clip["norm_type"],
}
FREEZE = {
    "freeze_groups": OptionSpec(int, 0, minimum=0, help="gradient freeze over this many parameter groups (0, 1: off)"),
    "freeze_type": OptionSpec(int, 1, minimum=0, maximum=1, help="0: continuous schedule, 1: interval (random)"),
    "freeze_p": OptionSpec(float, 0.7, minimum=0, maximum=0.99, help="share of steps that train every group"),
    "freeze_seed": OptionSpec(int, 0, minimum=0, help="seed of the interval schedule (same on every rank)"),
}
WRAPPER_OPTIONS = {**ACCUMULATION, **LOSS_SCALING, **CLIPPING, **FREEZE}
# an option that only means something with another one switched on
REQUIRES = {
    **{name: "loss_scale" for name in LOSS_SCALING if name != "loss_scale"},
    "norm_type": "max_grad_norm",
    **{name: "freeze_groups" for name in FREEZE if name != "freeze_groups"},
    "sparsify_threshold": "sparsify",
}
OFF = {"loss_scale": "off", "max_grad_norm": 0.0, "freeze_groups": 0, "sparsify": 0.0, "compress": "none"}
# options that cannot be on together, and why
CONFLICTS = {
    ("sparsify", "loss_scale"): "residuals would mix gradients scaled by different loss scales",
    ("sparsify", "compress"): "sparsified values are sent at full precision; pick one",
}


def check_combination(mode: str, given: dict[str, Any], values: dict[str, Any]) -> None:
    """Options that need another one switched on, and pairs that do not compose, are errors."""
    for name in given:
        needed = REQUIRES.get(name)
        if needed is not None and values.get(needed) == OFF[needed]:
            raise ConfigurationError(
                f"option '{name}' of mode '{mode}' only applies with '{needed}' switched on; set {needed}=... "
                f"or drop {name}."
            )
    for (a, b), why in CONFLICTS.items():
        if a in values and b in values and values[a] != OFF[a] and values[b] != OFF[b]:
            raise ConfigurationError(f"options '{a}' and '{b}' do not compose in mode '{mode}': {why}.")


def compose(recipe: Recipe, values: dict[str, Any]) -> Strategy:
    """The strategy for a recipe with the wrapping options in ``values`` (defaults where absent)."""
    opts = {name: spec.default for name, spec in WRAPPER_OPTIONS.items()} | values
    steps = opts["accumulate_steps"]
    groups = opts["freeze_groups"] if opts["freeze_groups"] > 1 else 0
    scaling = _loss_scale(opts)
    clip = None
    if opts["max_grad_norm"]:
        clip = ClipGradNorm(max_norm=opts["max_grad_norm"], norm_type=opts["norm_type"], axis=recipe.gradient_axis)

    sharded = recipe.micro_tail is not None

    def pipeline(variant: str, index: int | None) -> list[Pass]:
        apply = variant != ACCUMULATE
        passes = list(recipe.prefix)
        if index is not None:
            passes.append(FreezeGroups(groups=groups, index=index))
        passes += recipe.seed
        if steps > 1 and not sharded:
            passes.append(AccumulateGrads(steps=steps, apply=apply))
        if apply:
            passes += recipe.body[variant]
        elif sharded:
            passes += recipe.body["step"] if recipe.micro_body is None else recipe.micro_body
        if steps > 1 and sharded:
            passes.append(AccumulateGrads(steps=steps, apply=apply, reduced=True))
        if scaling is not None:
            passes.append(scaling if apply else LossScale(**{**_fields(scaling), "apply": False}))
        if apply and clip is not None:
            passes.append(clip)
        return passes + list(recipe.tail if apply else recipe.micro_tail or [])

    names = ([ACCUMULATE] if steps > 1 else []) + list(recipe.body)
    if groups:
        variants = {f"{v}/freeze{i}": pipeline(v, i) for v in names for i in range(groups)}
    else:
        variants = {v: pipeline(v, None) for v in names}

    def schedule() -> Any:
        inner = recipe.schedule()
        if steps > 1:
            inner = AccumulationSchedule(inner, steps)
        if groups:
            inner = FreezeSchedule(inner, groups, opts["freeze_type"], opts["freeze_p"], opts["freeze_seed"])
        return inner

    def check(optimizer: torch.optim.Optimizer) -> None:
        recipe.check(optimizer)
        if groups:
            _freeze_check(optimizer)

    return Strategy(variants, schedule, recipe.groups, check, recipe.replicated, recipe.outer, recipe.axes)


def _fields(p: Pass) -> dict[str, Any]:
    return {name: getattr(p, name) for name in field_options(type(p))}


def _loss_scale(opts: dict[str, Any]) -> LossScale | None:
    mode = opts["loss_scale"]
    if mode == "off":
        return None
    dynamic = mode == "dynamic"
    tuning = {k: opts[k] for k in ("growth_factor", "backoff_factor", "growth_interval", "min_scale")}
    return LossScale(init_scale=opts["init_scale"] if dynamic else mode, dynamic=dynamic, **tuning)


def _freeze_check(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) is not torch.optim.SGD:
        raise ConfigurationError(
            f"gradient freeze (freeze_groups) works with torch.optim.SGD; {type(optimizer).__name__} keeps one "
            "step count per param group, which frozen parameters would split. Use SGD, or no freeze."
        )
