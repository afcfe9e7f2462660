"""The option tables modes share. An option is typed once, where it belongs: at a pass (its field) or here, for
the options a mode has that no pass does. Tables that take a pass's options read the pass when they are first
asked for (the registry then loads its module), never while this package loads: loading the ``transpiler``
package loads no pass (``passes/registry.py``)."""

from __future__ import annotations

import dataclasses
import functools

from passes.registry import PASSES
from transpiler.graph.options import OptionSpec, field_options
from transpiler.graph.pipeline import Pass


def make(name: str, **options: object) -> Pass:
    """The pass ``name`` with ``options``, its module loaded on first use."""
    return PASSES[name](**options)


def pass_option(pass_name: str, option: str, **changes: object) -> OptionSpec:
    """Option ``option`` of pass ``pass_name``, with ``changes`` (another default, say)."""
    spec = field_options(PASSES[pass_name])[option]
    return dataclasses.replace(spec, **changes) if changes else spec


def own_options(pass_name: str) -> dict[str, OptionSpec]:
    """A pass's own options, without those every pass has (``axis``), which a mode sets itself."""
    common = field_options(Pass)
    return {name: spec for name, spec in field_options(PASSES[pass_name]).items() if name not in common}


# the wrapping strategies (composition.py), which compose with a mode's own options
ACCUMULATION = {"accumulate_steps": OptionSpec(int, 1, minimum=1, help="micro-steps per optimizer update (1: off)")}
LOSS_SCALE_TUNING = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale")
FREEZE = {
    "freeze_groups": OptionSpec(int, 0, minimum=0, help="gradient freeze over this many parameter groups (0, 1: off)"),
    "freeze_type": OptionSpec(int, 1, minimum=0, maximum=1, help="0: continuous schedule, 1: interval (random)"),
    "freeze_p": OptionSpec(float, 0.7, minimum=0, maximum=0.99, help="share of steps that train every group"),
    "freeze_seed": OptionSpec(int, 0, minimum=0, help="seed of the interval schedule (same on every rank)"),
}


@functools.cache
def loss_scaling() -> dict[str, OptionSpec]:
    words = (("dynamic", "dynamic"), ("off", "off"))
    return {
        "loss_scale": OptionSpec(
            float, "off", minimum=1e-30, words=words, help="'dynamic' (GradScaler's rule), a fixed scale, or 'off'"
        ),
        **{name: pass_option("loss-scale", name) for name in LOSS_SCALE_TUNING},
    }


@functools.cache
def clipping() -> dict[str, OptionSpec]:
    return {
        "max_grad_norm": OptionSpec(
            float, 0.0, minimum=0, help="clip the reduced gradients to this global norm (0: off)"
        ),
        "norm_type": pass_option("clip-grad-norm", "norm_type"),
    }


@functools.cache
def wrapper_options() -> dict[str, OptionSpec]:
    """Every option of the wrapping strategies: accumulation, loss scaling, clipping, freeze."""
    return {**ACCUMULATION, **loss_scaling(), **clipping(), **FREEZE}


# the modes' own
@functools.cache
def buckets() -> dict[str, OptionSpec]:
    return {name: pass_option("local-sgd-average", name) for name in ("bucket_cap_mb", "first_bucket_mb")}


@functools.cache
def fused_buckets() -> dict[str, OptionSpec]:
    """``bucket_cap_mb`` takes ``"auto"`` here."""
    names = ("bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view")
    return {name: pass_option("fuse-allreduce", name) for name in names}


@functools.cache
def zero3_buckets() -> dict[str, OptionSpec]:
    """``bucket_cap_mb`` takes ``"cost"`` here, its default (gather units sized on the measured all-gather cost),
    and ``"layer"`` (about one layer gathered at a time)."""
    return {
        "bucket_cap_mb": pass_option("shard-optimizer", "bucket_cap_mb", default="cost"),
        "first_bucket_mb": buckets()["first_bucket_mb"],
    }


@functools.cache
def compress() -> dict[str, OptionSpec]:
    return {"compress": pass_option("fuse-allreduce", "compress")}


@functools.cache
def sparsify() -> dict[str, OptionSpec]:
    return {
        "sparsify": OptionSpec(float, 0.0, minimum=0, maximum=1, help="send this share of each bucket, top-K (0: off)"),
        "sparsify_threshold": pass_option("sparse-allreduce", "threshold"),
    }


@functools.cache
def local_sgd() -> dict[str, OptionSpec]:
    return {
        "begin_step": OptionSpec(int, 1, minimum=0, help="steps 1..begin_step all synchronise (warm-up)"),
        "average_state": pass_option("local-sgd-average", "average_state"),
        **buckets(),
        **compress(),
        **ACCUMULATION,
    }


@functools.cache
def local_size() -> dict[str, OptionSpec]:
    return {"local_size": pass_option("adasum", "local_size")}


REPLICA_SIZE = {
    "replica_size": OptionSpec(int, 1, minimum=1, help="ranks per replica, data parallel inside it (HSDP's layout)"),
    "replica_mode": OptionSpec(
        str,
        "fused_allreduce",
        choices=("fused_allreduce", "zero1", "zero2"),
        help="data parallel inside a replica: gradients all-reduced, or the optimizer state sharded (ZeRO-1/2)",
    ),
}


@functools.cache
def offload() -> dict[str, OptionSpec]:
    return {"offload_global": pass_option("diloco-outer-step", "offload")}
