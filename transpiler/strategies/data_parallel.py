"""The configs of the modes that keep every rank in step: each step's gradients are combined across the ranks
(all-reduced, all-gathered, reduce-scattered to shards, AdaSum'd) before every rank applies the same update. Each
builds its pipeline from the passes that read its fields."""

from __future__ import annotations

from dataclasses import dataclass

import passes
from transpiler.errors import ConfigurationError
from transpiler.graph.pipeline import Pass
from transpiler.graph.rank_layouts import AdaSumLayout

from .checks import HAS_TWIN, BasisReadable, Elementwise, PlainSGD, SGDWithoutMomentum
from .config import feature, knob, own
from .features import Accumulation, Clipping, Compression, Freeze, LossScaling, Sparsification
from .mode_config import ModeConfig, ModeName
from .strategy import Recipe


def prefix() -> list[Pass]:
    return [passes.BroadcastParams()]


def update() -> list[Pass]:
    """The update on flat buffers where it can run there, else as multi-tensor ops per group of parameters."""
    return [passes.FlattenUpdate(), passes.ForeachUpdate()]


def tail() -> list[Pass]:
    return [*update(), passes.ScheduleCollectives(), passes.ReinplaceOptimizer()]


@dataclass(frozen=True, kw_only=True, repr=False)
class NoSync(ModeConfig):
    """No passes: the traced single-process step as it is, each rank on its own."""

    names = (ModeName("none", "no passes: the traced single-process step as it is"),)

    def recipe(self) -> Recipe:
        return Recipe({"step": []})


@dataclass(frozen=True, kw_only=True, repr=False)
class DataParallel(ModeConfig):
    """Data parallel as DDP: the loss gradient scaled by 1/W and every gradient summed across the ranks, in buckets
    (``fused``, DDP's caps) or one all-reduce each (Paddle's GradAllReduce)."""

    names = (
        ModeName(
            "allreduce",
            "Paddle GradAllReduce: scale the loss grad, one all-reduce per gradient",
            {"fused": False},
            without=("bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view", "compression", "sparsification"),
            why="it reduces each gradient on its own, and these apply to buckets (fused_allreduce)",
        ),
        ModeName(
            "fused_allreduce",
            "like allreduce, with gradients coalesced into dtype/size buckets (DDP-style caps)",
            {"fused": True},
        ),
    )
    in_place_under_quorum = True
    fused: bool = own(True, help="gradients in dtype/size buckets, one all-reduce each; false: one per gradient")
    bucket_cap_mb: float | str = knob(25.0, of="fuse-allreduce")
    first_bucket_mb: float = knob(1.0, of="fuse-allreduce")
    gradient_as_bucket_view: bool = knob(True, of="fuse-allreduce")
    compression: Compression | None = feature(Compression)
    sparsification: Sparsification | None = feature(Sparsification)
    accumulation: Accumulation | None = feature(Accumulation)
    loss_scaling: LossScaling | None = feature(LossScaling)
    clipping: Clipping | None = feature(Clipping)
    freeze: Freeze | None = feature(Freeze)

    def check(self) -> None:
        if self.sparsification is not None:
            if self.compression is not None:
                raise ConfigurationError(
                    "sparsification and compression do not compose: sparsified values are sent at full precision; "
                    "pick one."
                )
            if self.loss_scaling is not None:
                raise ConfigurationError(
                    "sparsification and loss_scaling do not compose: residuals would mix gradients scaled by "
                    "different loss scales."
                )
            if isinstance(self.bucket_cap_mb, str):
                raise ConfigurationError("sparsification cuts buckets of a fixed cap: give bucket_cap_mb in MiB.")

    def recipe(self) -> Recipe:
        seed = [passes.ScaleLossGrad()]
        if not self.fused:
            return Recipe({"step": [passes.AllReduceGrads()]}, prefix(), seed, tail(), replicated=True)
        caps = {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_mb": self.first_bucket_mb}
        sparse = self.sparsification
        if sparse is not None:
            reduce: Pass = passes.SparseAllReduce(ratio=sparse.ratio, threshold=sparse.threshold, **caps)
        else:
            wire = self.compression.wire_dtype if self.compression is not None else "none"
            reduce = passes.FuseAllReduce(**caps, wire_dtype=wire, gradient_as_bucket_view=self.gradient_as_bucket_view)
        return Recipe({"step": [reduce]}, prefix(), seed, tail(), replicated=sparse is None)


# what only ZeRO-3 takes: how it gathers the parameters it holds as slices
WHOLE_PARAMETERS = ("reshard_after_forward", "prefetch")
HELD_WHOLE = "they say how ZeRO-3 gathers the parameters it holds as slices, and stages 1 and 2 hold them whole"


@dataclass(frozen=True, kw_only=True, repr=False)
class ZeRO(ModeConfig):
    """ZeRO (DeepSpeed's stages; FSDP's full sharding at stage 3): gradient buckets reduce-scattered, each rank
    updating its 1/W slice of every parameter with 1/W of the optimizer state; stage 2 keeps a gradient bucket only
    until it is reduce-scattered, stage 3 holds the parameters as slices too, all-gathered where they are read."""

    names = (
        ModeName(
            "zero1",
            "ZeRO-1: reduce-scatter gradient buckets, update this rank's shard of the optimizer state, all-gather",
            {"stage": 1},
            without=WHOLE_PARAMETERS,
            why=HELD_WHOLE,
        ),
        ModeName(
            "zero2",
            "ZeRO-2: as zero1, and a gradient bucket lives only until it is reduce-scattered",
            {"stage": 2},
            without=WHOLE_PARAMETERS,
            why=HELD_WHOLE,
        ),
        ModeName(
            "zero3",
            "ZeRO-3 (fully sharded): as zero2, and parameters are held as shards, all-gathered where used",
            {"stage": 3},
        ),
    )
    two_levels_under_quorum = True
    stage: int = own(kind=int, minimum=1, maximum=3, help="1: optimizer state, 2: and gradients, 3: and parameters")
    # None: the stage's default, 25 MiB (DDP's cap) for stages 1 and 2, 'cost' for stage 3
    bucket_cap_mb: float | str | None = knob(None, of="shard-optimizer")
    first_bucket_mb: float = knob(1.0, of="shard-optimizer")
    reshard_after_forward: bool = knob(True, of="shard-params")
    prefetch: int = knob(1, of="shard-params")
    accumulation: Accumulation | None = feature(Accumulation)
    loss_scaling: LossScaling | None = feature(LossScaling)
    clipping: Clipping | None = feature(Clipping)

    def check(self) -> None:
        if self.bucket_cap_mb is None:
            object.__setattr__(self, "bucket_cap_mb", "cost" if self.stage == 3 else 25.0)
        if self.stage < 3 and isinstance(self.bucket_cap_mb, str):
            raise ConfigurationError(
                f"bucket_cap_mb={self.bucket_cap_mb!r} sizes ZeRO-3's gather units; stage {self.stage} wants a cap "
                "in MiB."
            )

    def recipe(self) -> Recipe:
        stage = self.stage
        shard = passes.ShardOptimizer(
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
            keep_gradient_buckets=stage == 1,
            module_buckets=stage == 3,  # ZeRO-3 gathers by bucket: a layer's parameters in one
        )
        # after loss scaling and clipping, which run on the slices: one update per bucket on this rank's flat shard,
        # then the updated shards gathered (ZeRO-1, 2); or keep the slices and gather the parameters where the
        # forward and backward read them (ZeRO-3), the slices views of this rank's flat shard of each bucket
        shard_params = passes.ShardParams(reshard_after_forward=self.reshard_after_forward, prefetch=self.prefetch)
        gather = [shard_params, *update()] if stage == 3 else [*update(), passes.GatherParams()]
        tail_ = [*gather, passes.ScheduleCollectives(), passes.ReinplaceOptimizer()]
        # ZeRO-1 accumulates whole gradients (no communication in a micro-step, as DDP's no_sync); ZeRO-2/3
        # reduce-scatter every micro-step into accumulators of this rank's slices, as DeepSpeed's stage 2
        micro = None if stage == 1 else ([shard_params] if stage == 3 else []) + [passes.ScheduleCollectives()]
        return Recipe(
            {"step": [shard]},
            prefix(),
            [passes.ScaleLossGrad()],
            tail_,
            checks=(Elementwise(f"zero{stage}"),),
            replicated=True,
            micro_tail=micro,
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class AdaSum(ModeConfig):
    """AdaSum by recursive vector halving (point-to-point exchanges), of the gradients before the optimizer, or of
    the weight deltas after a local step (MindSpore's AdaSumByDeltaWeight); ``local_size`` ranks averaged first."""

    names = (
        ModeName(
            "adasum",
            "AdaSum of gradients (recursive halving, point-to-point exchanges), then the optimizer",
            {"target": "grads"},
        ),
        ModeName(
            "adasum_delta",
            "local optimizer step, then AdaSum of the weight deltas (MindSpore AdaSumByDeltaWeight)",
            {"target": "deltas"},
            without=("accumulation", "loss_scaling"),
            why="it combines the weights after each local step, and these work on gradients (target='grads')",
        ),
    )
    target: str = knob("grads", of="adasum")
    local_size: int = knob(1, of="adasum")
    accumulation: Accumulation | None = feature(Accumulation)
    loss_scaling: LossScaling | None = feature(LossScaling)

    def recipe(self) -> Recipe:
        return Recipe(
            {"step": [passes.AdaSum(target=self.target, local_size=self.local_size)]},
            prefix(),
            tail=[*update(), passes.ReinplaceOptimizer()],
            layout=AdaSumLayout(self.local_size),
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class AllGather(ModeConfig):
    """Paddle's all-gather mode: every rank's gradients gathered in buckets, the optimizer applied once per rank's
    gradient (SGD, Adam and AdamW, through their functional twins)."""

    names = (
        ModeName(
            "allgather",
            "Paddle MultiThread all-gather: gather every rank's gradients, apply the optimizer once per gradient",
        ),
    )
    bucket_cap_mb: float = knob(25.0, of="allgather-grads")
    first_bucket_mb: float = knob(1.0, of="allgather-grads")

    def recipe(self) -> Recipe:
        gather = passes.AllGatherGrads(bucket_cap_mb=self.bucket_cap_mb, first_bucket_mb=self.first_bucket_mb)
        return Recipe({"step": [gather]}, prefix(), [passes.ScaleLossGrad()], tail(), checks=(HAS_TWIN,))


@dataclass(frozen=True, kw_only=True, repr=False)
class DimReduce(ModeConfig):
    """MindSpore Boost's DimReduce: the averaged gradients projected on a PCA basis (``transpiler pca``), a BFGS
    step there with an in-graph line search, and residual momentum; plain ``torch.optim.SGD`` (lr 1, as Boost)."""

    names = (
        ModeName(
            "dim_reduce",
            "MindSpore Boost DimReduce: averaged gradients, BFGS step in a PCA subspace with line search",
        ),
    )
    pca_path: str = knob("", of="dim-reduce")
    n_components: int = knob(0, of="dim-reduce")
    rho: float = knob(0.55, of="dim-reduce")
    gamma: float = knob(0.9, of="dim-reduce")
    alpha: float = knob(0.001, of="dim-reduce")
    sigma: float = knob(0.4, of="dim-reduce")
    bucket_cap_mb: float = knob(25.0, of="fuse-allreduce", words=())
    first_bucket_mb: float = knob(1.0, of="fuse-allreduce")

    def recipe(self) -> Recipe:
        reduce = passes.FuseAllReduce(bucket_cap_mb=self.bucket_cap_mb, first_bucket_mb=self.first_bucket_mb)
        step = passes.DimReduce(
            pca_path=self.pca_path,
            n_components=self.n_components,
            rho=self.rho,
            gamma=self.gamma,
            alpha=self.alpha,
            sigma=self.sigma,
        )
        # at transpile(), before anything is traced: the basis file and the optimizer
        checks = (BasisReadable(step), PlainSGD())
        return Recipe({"step": [reduce, step]}, prefix(), [passes.ScaleLossGrad()], tail(), checks=checks)


@dataclass(frozen=True, kw_only=True, repr=False)
class DeMo(ModeConfig):
    """DeMo as its authors' optimizer computes it: each rank's momentum kept local, the top-k 2-D DCT coefficients of
    each tile all-gathered per bucket, each averaged over the ranks that sent it, SGD on the sign of the mean; takes
    ``torch.optim.SGD`` without momentum."""

    names = (
        ModeName(
            "demo",
            "DeMo: each rank's momentum kept local, its top-k DCT coefficients per tile all-gathered, sign step",
        ),
    )
    compression_decay: float = knob(0.999, of="demo-exchange")
    chunk_size: int = knob(64, of="demo-exchange")
    topk: int = knob(32, of="demo-exchange")
    quantization_bins: int = knob(0, of="demo-exchange")
    quantization_range: float = knob(6.0, of="demo-exchange")
    sign: bool = knob(True, of="demo-exchange")
    weight_decay: float = knob(0.0, of="demo-exchange")
    bucket_cap_mb: float = knob(25.0, of="demo-exchange")
    first_bucket_mb: float = knob(1.0, of="demo-exchange")
    accumulation: Accumulation | None = feature(Accumulation)
    clipping: Clipping | None = feature(Clipping)

    def recipe(self) -> Recipe:
        """No loss-gradient scaling (the exchange takes the mean itself), each rank's momentum kept local."""
        exchange = passes.DeMoExchange(
            compression_decay=self.compression_decay,
            chunk_size=self.chunk_size,
            topk=self.topk,
            quantization_bins=self.quantization_bins,
            quantization_range=self.quantization_range,
            sign=self.sign,
            weight_decay=self.weight_decay,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
        )
        return Recipe({"step": [exchange]}, prefix(), [], tail(), checks=(SGDWithoutMomentum(),))
