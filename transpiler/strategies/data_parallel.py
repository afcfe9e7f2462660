"""The recipes of the modes that keep every rank in step: each step's gradients are combined across the ranks
(all-reduced, all-gathered, reduce-scattered to shards, AdaSum'd) before every rank applies the same update."""

from __future__ import annotations

from collections.abc import Callable

from transpiler.graph.pipeline import Pass
from transpiler.graph.rank_layouts import AdaSumLayout

from .checks import HAS_TWIN, BasisReadable, Elementwise, PlainSGD
from .options import make
from .strategy import Recipe


def prefix() -> list[Pass]:
    return [make("broadcast-params")]


def update() -> list[Pass]:
    """The update on flat buffers where it can run there, else as multi-tensor ops per group of parameters."""
    return [make("flatten-update"), make("foreach-update")]


def tail() -> list[Pass]:
    return [*update(), make("schedule-collectives"), make("reinplace-optimizer")]


def allreduce() -> Recipe:
    return Recipe({"step": [make("allreduce-grads")]}, prefix(), [make("scale-loss-grad")], tail(), replicated=True)


def fused(
    bucket_cap_mb: float | str,
    first_bucket_mb: float,
    gradient_as_bucket_view: bool,
    compress: str,
    sparsify: float,
    sparsify_threshold: float,
) -> Recipe:
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": first_bucket_mb}
    if sparsify:
        reduce = make("sparse-allreduce", ratio=sparsify, threshold=sparsify_threshold, **caps)
    else:
        reduce = make("fuse-allreduce", **caps, compress=compress, gradient_as_bucket_view=gradient_as_bucket_view)
    return Recipe({"step": [reduce]}, prefix(), [make("scale-loss-grad")], tail(), replicated=not sparsify)


def demo(
    compression_decay: float,
    compression_chunk: int,
    compression_topk: int,
    quantization_bins: int,
    quantization_range: float,
    sign: bool,
    weight_decay: float,
    **caps,
) -> Recipe:
    """DeMo: no loss-gradient scaling (the exchange takes the mean itself), each rank's momentum kept local."""
    exchange = make(
        "demo-exchange",
        decay=compression_decay,
        chunk=compression_chunk,
        topk=compression_topk,
        bins=quantization_bins,
        sigmas=quantization_range,
        sign=sign,
        weight_decay=weight_decay,
        **caps,
    )
    return Recipe({"step": [exchange]}, prefix(), [], tail())


def adasum(target: str) -> Callable[..., Recipe]:
    def build(local_size: int) -> Recipe:
        return Recipe(
            {"step": [make("adasum", target=target, local_size=local_size)]},
            prefix(),
            tail=[*update(), make("reinplace-optimizer")],
            layout=AdaSumLayout(local_size),
        )

    return build


def allgather(bucket_cap_mb: float, first_bucket_mb: float) -> Recipe:
    gather = make("allgather-grads", bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    return Recipe({"step": [gather]}, prefix(), [make("scale-loss-grad")], tail(), checks=(HAS_TWIN,))


def zero(stage: int) -> Callable[..., Recipe]:
    def build(
        bucket_cap_mb: float | str, first_bucket_mb: float, reshard_after_forward: bool = True, prefetch: int = 1
    ) -> Recipe:
        shard = make(
            "shard-optimizer",
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            keep_gradient_buckets=stage == 1,
            module_buckets=stage == 3,  # ZeRO-3 gathers by bucket: a layer's parameters in one
        )
        # after loss scaling and clipping, which run on the slices: one update per bucket on this rank's flat shard,
        # then the updated shards gathered (ZeRO-1, 2); or keep the slices and gather the parameters where the
        # forward and backward read them (ZeRO-3), the slices views of this rank's flat shard of each bucket
        shard_params = make("shard-params", reshard_after_forward=reshard_after_forward, prefetch=prefetch)
        gather = [shard_params, *update()] if stage == 3 else [*update(), make("gather-params")]
        tail_ = [*gather, make("schedule-collectives"), make("reinplace-optimizer")]
        # ZeRO-1 accumulates whole gradients (no communication in a micro-step, as DDP's no_sync); ZeRO-2/3
        # reduce-scatter every micro-step into accumulators of this rank's slices, as DeepSpeed's stage 2
        micro = None if stage == 1 else ([shard_params] if stage == 3 else []) + [make("schedule-collectives")]
        return Recipe(
            {"step": [shard]},
            prefix(),
            [make("scale-loss-grad")],
            tail_,
            checks=(Elementwise(f"zero{stage}"),),
            replicated=True,
            micro_tail=micro,
        )

    return build


def dim_reduce(
    pca_path: str,
    n_components: int,
    rho: float,
    gamma: float,
    alpha: float,
    sigma: float,
    bucket_cap_mb: float,
    first_bucket_mb: float,
) -> Recipe:
    reduce = make("fuse-allreduce", bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    step = make(
        "dim-reduce", pca_path=pca_path, n_components=n_components, rho=rho, gamma=gamma, alpha=alpha, sigma=sigma
    )
    # at transpile(), before anything is traced: the basis file and the optimizer
    checks = (BasisReadable(step), PlainSGD())
    return Recipe({"step": [reduce, step]}, prefix(), [make("scale-loss-grad")], tail(), checks=checks)
