"""Modes: named pass pipelines with their options, and how a mode name or a pipeline spec becomes a Strategy.

The recipes live by family (``data_parallel.py``, ``local_updates.py``, ``diloco.py``), the shared option tables
in ``options.py``, the checks in ``checks.py``; this module names them. The table is made on first use
(:func:`modes`), since its options are the passes' own and a pass loads when it is first named.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from passes.registry import PASSES
from transpiler.errors import ConfigurationError
from transpiler.graph.options import OptionSpec, parse_options
from transpiler.graph.pipeline import Pass, parse_spec

from . import data_parallel, diloco, local_updates, options
from .composition import check_combination, compose
from .options import ACCUMULATION, REPLICA_SIZE, pass_option
from .strategy import Recipe, Strategy


@dataclass(frozen=True)
class Mode:
    name: str
    summary: str
    build: Callable[..., Recipe]
    options: dict[str, OptionSpec]

    def strategy(self, **given: Any) -> Strategy:
        """The strategy for these options, each parsed strictly (``ConfigurationError`` names a bad one).

        Defaults come from the option specs, the one place they are written.
        The mode's own options go to its recipe; the wrapping ones
        (accumulation, loss scaling, clipping, freeze) to :func:`compose`.
        """
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ConfigurationError(self._unknown(unknown))
        parsed = parse_options(self.options, given, f"mode '{self.name}'")
        values = {name: spec.default for name, spec in self.options.items()} | parsed
        check_combination(self.name, parsed, values)
        wrappers = options.wrapper_options()
        own = {k: v for k, v in values.items() if k not in wrappers}
        return compose(self.build(**own), {k: v for k, v in values.items() if k in wrappers})

    def _unknown(self, names: list[str]) -> str:
        where = []
        for name in names:
            modes_ = [m.name for m in modes().values() if name in m.options]
            where.append(f"'{name}' works with {', '.join(modes_)}" if modes_ else f"'{name}' is no option of any mode")
        known = ", ".join(self.options) or "none"
        return (
            f"mode '{self.name}' takes no option(s) {names} ({'; '.join(where)}; see docs/strategies/composition.md). "
            f"Its options: {known}."
        )


def _diloco_options() -> dict[str, OptionSpec]:
    return {
        "sync_every": OptionSpec(int, 100, minimum=1, help="inner steps per outer round (H)"),
        **REPLICA_SIZE,
        **options.offload(),
        **options.buckets(),
        **ACCUMULATION,
        **options.clipping(),
    }


def _streaming_options() -> dict[str, OptionSpec]:
    return {
        "sync_every": OptionSpec(int, 100, minimum=1, help="inner steps between two syncs of a fragment (H)"),
        "fragments": OptionSpec(int, 4, minimum=1, help="fragments of whole modules, balanced by size (P)"),
        "fragment_sync_delay": OptionSpec(
            int, 0, minimum=0, help="inner steps between starting a fragment's exchange and applying it (τ)"
        ),
        "fragment_update_alpha": OptionSpec(
            float, 0.0, minimum=0, maximum=1, help="keep alpha * local + (1 - alpha) * global at a sync"
        ),
        "exchange_dtype": pass_option("diloco-outer-step", "exchange"),
        **REPLICA_SIZE,
        **options.offload(),
        **ACCUMULATION,
        **options.clipping(),
    }


def _sparseloco_options() -> dict[str, OptionSpec]:
    return {
        "sync_every": OptionSpec(int, 15, minimum=1, help="inner steps per outer round (H)"),
        "outer_lr": OptionSpec(
            float, 1.0, minimum=0, help="α: e = β·e + α·Δ, and θ_global − α × the mean of what the replicas sent"
        ),
        "error_decay": pass_option("diloco-outer-step", "error_decay", default=0.95),
        "chunk_size": pass_option("diloco-outer-step", "chunk"),
        "topk": pass_option("diloco-outer-step", "topk", default=128, minimum=1),
        "quantization_bins": pass_option("diloco-outer-step", "bins", default=4),
        "quantization_range": pass_option("diloco-outer-step", "sigmas"),
        **REPLICA_SIZE,
        **options.offload(),
        **ACCUMULATION,
        **options.clipping(),
    }


def _demo_options() -> dict[str, OptionSpec]:
    return {
        "compression_decay": pass_option("demo-exchange", "decay"),
        "compression_chunk": pass_option("demo-exchange", "chunk"),
        "compression_topk": pass_option("demo-exchange", "topk"),
        "quantization_bins": pass_option("demo-exchange", "bins"),
        "quantization_range": pass_option("demo-exchange", "sigmas"),
        "sign": pass_option("demo-exchange", "sign"),
        "weight_decay": pass_option("demo-exchange", "weight_decay"),
        **options.buckets(),
        **ACCUMULATION,
        **options.clipping(),
    }


@functools.cache
def modes() -> dict[str, Mode]:
    """Every mode by name, in the order ``transpiler modes`` lists them."""
    wrappers, buckets = options.wrapper_options(), options.buckets()
    wrapped = {**ACCUMULATION, **options.loss_scaling(), **options.clipping()}  # what sharded modes compose with
    table = (
        Mode("none", "no passes: the traced single-process step as it is", lambda: Recipe({"step": []}), {}),
        Mode(
            "allreduce",
            "Paddle GradAllReduce: scale the loss grad, one all-reduce per gradient",
            data_parallel.allreduce,
            wrappers,
        ),
        Mode(
            "fused_allreduce",
            "like allreduce, with gradients coalesced into dtype/size buckets (DDP-style caps)",
            data_parallel.fused,
            {**options.fused_buckets(), **options.compress(), **options.sparsify(), **wrappers},
        ),
        Mode(
            "local_sgd",
            "Paddle LocalSGD: local steps, parameters averaged through snapshot deltas every k_steps",
            local_updates.local_sgd,
            {"k_steps": OptionSpec(int, 1, minimum=1, help="synchronise every k steps"), **options.local_sgd()},
        ),
        Mode(
            "adaptive_local_sgd",
            "LocalSGD whose k follows Paddle's rule sqrt(lr_0*loss/(lr*loss_0)*init_k), clipped to [1, 16]",
            local_updates.adaptive_local_sgd,
            {"init_k_steps": OptionSpec(int, 1, minimum=1, help="k at the start, then adapted"), **options.local_sgd()},
        ),
        Mode(
            "diloco",
            "DiLoCo: H local steps of the inner optimizer, then an outer optimizer on the averaged pseudo-gradients",
            diloco.diloco,
            _diloco_options(),
        ),
        Mode(
            "streaming_diloco",
            "Streaming DiLoCo: fragments sync in turn, each exchange overlapping inner steps, low-precision wire",
            diloco.streaming_diloco,
            _streaming_options(),
        ),
        Mode(
            "sparseloco",
            "SparseLoCo: DiLoCo rounds sending the top-k of each tile of an error buffer, quantised; outer SGD",
            diloco.sparseloco,
            _sparseloco_options(),
        ),
        Mode(
            "demo",
            "DeMo: each rank's momentum kept local, its top-k DCT coefficients per tile all-gathered, sign step",
            data_parallel.demo,
            _demo_options(),
        ),
        Mode(
            "adasum",
            "AdaSum of gradients (recursive halving, point-to-point exchanges), then the optimizer",
            data_parallel.adasum("grads"),
            {**options.local_size(), **ACCUMULATION, **options.loss_scaling()},
        ),
        Mode(
            "adasum_delta",
            "local optimizer step, then AdaSum of the weight deltas (MindSpore AdaSumByDeltaWeight)",
            data_parallel.adasum("deltas"),
            options.local_size(),
        ),
        Mode(
            "allgather",
            "Paddle MultiThread all-gather: gather every rank's gradients, apply the optimizer once per gradient",
            data_parallel.allgather,
            buckets,
        ),
        Mode(
            "dim_reduce",
            "MindSpore Boost DimReduce: averaged gradients, BFGS step in a PCA subspace with line search",
            data_parallel.dim_reduce,
            {**options.own_options("dim-reduce"), **buckets},
        ),
        Mode(
            "zero1",
            "ZeRO-1: reduce-scatter gradient buckets, update this rank's shard of the optimizer state, all-gather",
            data_parallel.zero(1),
            {**buckets, **wrapped},
        ),
        Mode(
            "zero2",
            "ZeRO-2: as zero1, and a gradient bucket lives only until it is reduce-scattered",
            data_parallel.zero(2),
            {**buckets, **wrapped},
        ),
        Mode(
            "zero3",
            "ZeRO-3 (fully sharded): as zero2, and parameters are held as shards, all-gathered where used",
            data_parallel.zero(3),
            {**options.zero3_buckets(), **wrapped, **options.own_options("shard-params")},
        ),
        Mode(
            "partial_sync",
            "SINGA partial update: local updates every step, one partition of the parameters averaged per step",
            local_updates.partial_sync,
            {"partitions": pass_option("partial-average", "partitions"), **buckets},
        ),
    )
    return {m.name: m for m in table}


def build_passes(mode: str, given: dict[str, Any]) -> list[Pass]:
    """Passes for a single-variant mode name with its options, or for an explicit pipeline spec."""
    variants = build_strategy(mode, given).variants
    if list(variants) != ["step"]:
        raise ConfigurationError(f"mode '{mode}' has several program variants ({', '.join(variants)}).")
    return variants["step"]


def build_strategy(mode: str, given: dict[str, Any]) -> Strategy:
    """The strategy for a mode name with its options, or for an explicit pipeline spec."""
    if not isinstance(mode, str):
        raise ConfigurationError(f"mode must be a mode name or a pipeline spec (a str), got {type(mode).__name__}.")
    table = modes()
    if mode in table:
        return table[mode].strategy(**given)
    if given:
        raise ConfigurationError(
            f"options {sorted(given)} only apply to named modes; put pass options in the spec, "
            "e.g. 'fuse-allreduce{bucket-cap-mb=4}'."
        )
    if not any(c in mode for c in ",{") and mode not in PASSES:
        raise ConfigurationError(
            f"unknown mode '{mode}'. Modes: {', '.join(table)}; or give a pipeline spec of passes "
            f"({', '.join(PASSES)}), e.g. 'scale-loss-grad,allreduce-grads'."
        )
    return Strategy({"step": parse_spec(mode, PASSES)})
