"""Strategies that wrap any mode's pipeline: accumulation, loss scaling, clipping, gradient freeze.

A mode describes its pipeline as a :class:`Recipe` in parts; :func:`compose`
weaves the wrapping strategies in at fixed places, so each combination is
one well-defined pipeline per program variant:

``prefix  [freeze-groups]  seed  [accumulate-grads]  body  [loss-scale]  [clip-grad-norm]  tail``

Accumulation micro-steps run ``prefix [freeze] seed accumulate-grads{apply=false}
[loss-scale{apply=false}]`` (no body: nothing is reduced or updated). A recipe with a ``micro_tail`` (ZeRO-2
and ZeRO-3) reduces every micro-step and accumulates this rank's reduced slices instead: ``... seed body
accumulate-grads{reduced=true} ...``, micro-steps ending with the ``micro_tail``. Which
feature composes with which mode is which feature fields the mode's config has (``docs/strategies/composition.md``);
the pairs that do not compose are refused when a config is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import passes
from transpiler.graph.pipeline import Pass

from .checks import FREEZE_SGD
from .features import Accumulation, Clipping, Freeze, LossScaling
from .schedules import ACCUMULATE, AccumulationSchedule, FreezeSchedule, Schedule
from .strategy import Recipe, Strategy


@dataclass(frozen=True)
class Wrapping:
    """The wrapping features a mode's config switches on (None: off)."""

    accumulation: Accumulation | None = None
    loss_scaling: LossScaling | None = None
    clipping: Clipping | None = None
    freeze: Freeze | None = None


def compose(recipe: Recipe, wrapping: Wrapping) -> Strategy:
    """The strategy for a recipe with the wrapping features switched on."""
    steps = wrapping.accumulation.steps if wrapping.accumulation is not None else 1
    groups = wrapping.freeze.groups if wrapping.freeze is not None else 0
    scaling = _loss_scale(wrapping.loss_scaling)
    clip = None
    if wrapping.clipping is not None:
        norm = {"max_norm": wrapping.clipping.max_norm, "norm_type": wrapping.clipping.norm_type}
        clip = passes.ClipGradNorm(**norm, axis=recipe.gradient_axis)

    sharded = recipe.micro_tail is not None

    def pipeline(variant: str, index: int | None) -> list[Pass]:
        apply = variant != ACCUMULATE
        passes_ = list(recipe.prefix)
        if index is not None:
            passes_.append(passes.FreezeGroups(groups=groups, index=index))
        passes_ += recipe.seed
        if steps > 1 and not sharded:
            passes_.append(passes.AccumulateGrads(steps=steps, apply=apply))
        if apply:
            passes_ += recipe.body[variant]
        elif sharded:
            passes_ += recipe.body["step"] if recipe.micro_body is None else recipe.micro_body
        if steps > 1 and sharded:
            passes_.append(passes.AccumulateGrads(steps=steps, apply=apply, reduced=True))
        if scaling is not None:
            passes_.append(scaling if apply else dataclasses.replace(scaling, apply=False))
        if apply and clip is not None:
            passes_.append(clip)
        return passes_ + list(recipe.tail if apply else recipe.micro_tail or [])

    names = ([ACCUMULATE] if steps > 1 else []) + list(recipe.body)
    if groups:
        variants = {f"{v}/freeze{i}": pipeline(v, i) for v in names for i in range(groups)}
    else:
        variants = {v: pipeline(v, None) for v in names}
    schedule: Schedule = recipe.schedule
    if steps > 1:
        schedule = AccumulationSchedule(schedule, steps)
    if wrapping.freeze is not None:
        f = wrapping.freeze
        schedule = FreezeSchedule(schedule, groups, f.type, f.p, f.seed)
    checks = recipe.checks + ((FREEZE_SGD,) if groups else ())
    return Strategy(variants, schedule, recipe.layout, checks, recipe.replicated, recipe.outer, recipe.outer_sgd)


def _loss_scale(scaling: LossScaling | None) -> Pass | None:
    if scaling is None:
        return None
    return passes.LossScale(**scaling.to_dict())
