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
built from :func:`options.wrapper_options` and each mode's option list.
"""

from __future__ import annotations

from typing import Any

from transpiler.errors import ConfigurationError
from transpiler.graph.options import field_options
from transpiler.graph.pipeline import Pass

from .checks import FREEZE_SGD
from .options import FREEZE, LOSS_SCALE_TUNING, make, wrapper_options
from .schedules import ACCUMULATE, AccumulationSchedule, FreezeSchedule, Schedule
from .strategy import Recipe, Strategy

# an option that only means something with another one switched on
REQUIRES = {
    **{name: "loss_scale" for name in LOSS_SCALE_TUNING},
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
    opts = {name: spec.default for name, spec in wrapper_options().items()} | values
    steps = opts["accumulate_steps"]
    groups = opts["freeze_groups"] if opts["freeze_groups"] > 1 else 0
    scaling = _loss_scale(opts)
    clip = None
    if opts["max_grad_norm"]:
        norm = {"max_norm": opts["max_grad_norm"], "norm_type": opts["norm_type"]}
        clip = make("clip-grad-norm", **norm, axis=recipe.gradient_axis)

    sharded = recipe.micro_tail is not None

    def pipeline(variant: str, index: int | None) -> list[Pass]:
        apply = variant != ACCUMULATE
        passes = list(recipe.prefix)
        if index is not None:
            passes.append(make("freeze-groups", groups=groups, index=index))
        passes += recipe.seed
        if steps > 1 and not sharded:
            passes.append(make("accumulate-grads", steps=steps, apply=apply))
        if apply:
            passes += recipe.body[variant]
        elif sharded:
            passes += recipe.body["step"] if recipe.micro_body is None else recipe.micro_body
        if steps > 1 and sharded:
            passes.append(make("accumulate-grads", steps=steps, apply=apply, reduced=True))
        if scaling is not None:
            passes.append(scaling if apply else make("loss-scale", **{**_fields(scaling), "apply": False}))
        if apply and clip is not None:
            passes.append(clip)
        return passes + list(recipe.tail if apply else recipe.micro_tail or [])

    names = ([ACCUMULATE] if steps > 1 else []) + list(recipe.body)
    if groups:
        variants = {f"{v}/freeze{i}": pipeline(v, i) for v in names for i in range(groups)}
    else:
        variants = {v: pipeline(v, None) for v in names}
    schedule: Schedule = recipe.schedule
    if steps > 1:
        schedule = AccumulationSchedule(schedule, steps)
    if groups:
        schedule = FreezeSchedule(schedule, groups, opts["freeze_type"], opts["freeze_p"], opts["freeze_seed"])
    checks = recipe.checks + ((FREEZE_SGD,) if groups else ())
    return Strategy(variants, schedule, recipe.layout, checks, recipe.replicated, recipe.outer, recipe.outer_sgd)


def _fields(p: Pass) -> dict[str, Any]:
    return {name: getattr(p, name) for name in field_options(type(p))}


def _loss_scale(opts: dict[str, Any]) -> Pass | None:
    mode = opts["loss_scale"]
    if mode == "off":
        return None
    dynamic = mode == "dynamic"
    tuning = {k: opts[k] for k in ("growth_factor", "backoff_factor", "growth_interval", "min_scale")}
    return make("loss-scale", init_scale=opts["init_scale"] if dynamic else mode, dynamic=dynamic, **tuning)
