"""The configs of DiLoCo, Streaming DiLoCo and SparseLoCo: H inner steps of the user's optimizer on each replica,
then an outer step on the averaged pseudo-gradients; each replica one rank, or R ranks in data parallel (HSDP's
layout)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import passes
from transpiler.graph.pipeline import Pass
from transpiler.graph.rank_layouts import ReplicaLayout

from .checks import STREAMING_OUTER_SGD, Elementwise
from .config import feature, knob, own
from .data_parallel import prefix
from .features import Accumulation, Clipping
from .mode_config import ModeConfig, ModeName, Surroundings, not_under_quorum
from .schedules import DiLoCoSchedule, Schedule, StreamingDiLoCoSchedule
from .strategy import OptimizerCheck, OuterSGD, Recipe


@dataclass(frozen=True, kw_only=True, repr=False)
class Replicas(ModeConfig):
    """What the DiLoCo family shares: the period of the syncs, the replicas' layout, where θ_global lives, and the
    features they take."""

    sync_every: int = own(100, minimum=1, help="inner steps per outer round (H)")
    replica_size: int = own(1, minimum=1, help="ranks per replica, data parallel inside it (HSDP's layout)")
    replica_mode: str = own(
        "fused_allreduce",
        choices=("fused_allreduce", "zero1", "zero2"),
        help="data parallel inside a replica: gradients all-reduced, or the optimizer state sharded (ZeRO-1/2)",
    )
    offload_global: bool = knob(False, of="diloco-outer-step")
    accumulation: Accumulation | None = feature(Accumulation)
    clipping: Clipping | None = feature(Clipping)

    def refusal(self, surroundings: Surroundings) -> str | None:
        group = surroundings.quorum_group
        # checked here, not when the config is made: under a quorum the replica group gives the replica's size
        if group is None and self.replica_size == 1 and self.replica_mode != "fused_allreduce":
            return (
                f"replica_mode='{self.replica_mode}' shards each replica's optimizer state over its ranks, and "
                "replica_size=1 makes every rank its own replica: give replica_size=R (R ranks per replica), or drop "
                "replica_mode."
            )
        if surroundings.cuda_graph:
            return (
                f"cuda_graph=True is not built for mode '{self.mode}': its programs hand an exchange in flight from "
                "one to the next, and the outer step's writes to the global weights are not checked under capture. "
                "Leave cuda_graph off (compile=True works)."
            )
        if surroundings.tensor_parallel and self.replica_size != 1:
            return (
                "replica_size does not run beside a tensor-parallel plan: the replicas of a 2-D data-parallel layout "
                "would need a third mesh dimension. Leave it out."
            )
        if group is not None and self.replica_size not in (1, group):
            return (
                f"under fault_tolerance a replica is one replica group, of {group} rank(s) here; replica_size="
                f"{self.replica_size} disagrees. Leave replica_size out."
            )
        if group is not None and group > 1 and self.replica_mode == "fused_allreduce":
            return (
                f"under fault_tolerance a replica group of several ranks ({group} here) shards its inner optimizer "
                "state: give replica_mode='zero1' or 'zero2'. A returning group's ranks heal from the peers torchft "
                "picks for each, which are mid-round with optimizer states of their own; a whole copy per rank would "
                "leave the group's ranks with different states, a slice per rank does not."
            )
        return None

    def for_quorum(self, group: int) -> Replicas:
        return dataclasses.replace(self, replica_size=group) if group > 1 else self

    @property
    def axis(self) -> str:
        """The ranks the outer step works across: all of them, or one of each replica (axis ``across``)."""
        return "across" if self.replica_size > 1 else "world"

    def replicas(
        self, body: dict[str, list[Pass]], caps: dict, schedule: Schedule, outer: tuple[OptimizerCheck, ...]
    ) -> Recipe:
        """A DiLoCo recipe: each variant's ``body``, after data parallel inside replicas of ``replica_size`` ranks
        (none when each rank is its own replica), by ``replica_mode``: ``fused_allreduce``, or ZeRO-1/2 over the
        replica's ranks (the inner optimizer's state sharded, the updated parameters gathered whole before the outer
        step reads them)."""
        seed: list[Pass] = []
        micro_tail: list[Pass] | None = None
        micro_body: list[Pass] | None = None
        checks: tuple[OptimizerCheck, ...] = ()
        inside = self.replica_mode
        if self.replica_size > 1:
            seed = [passes.ScaleLossGrad(axis="replica")]
            if inside == "fused_allreduce":
                inner: list[Pass] = [passes.FuseAllReduce(axis="replica", **caps)]
            else:
                stage = int(inside.removeprefix("zero"))
                shard = passes.ShardOptimizer(axis="replica", keep_gradient_buckets=stage == 1, **caps)
                inner = [shard, passes.GatherParams(axis="replica")]
                checks = (Elementwise(f"diloco with replica_mode='{inside}'"),)
                if stage == 2:  # micro-steps reduce-scatter into this rank's slices, as zero2's
                    micro_body, micro_tail = [shard], [passes.ScheduleCollectives()]
            body = {v: [*inner, *pipeline] for v, pipeline in body.items()}
        return Recipe(
            body,
            prefix(),
            seed,
            tail=[passes.ForeachUpdate(), passes.ScheduleCollectives(), passes.ReinplaceOptimizer()],
            schedule=schedule,
            layout=ReplicaLayout(self.replica_size),
            checks=checks,
            micro_tail=micro_tail,
            micro_body=micro_body,
            gradient_axis="replica" if self.replica_size > 1 else "world",
            outer=outer,
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class DiLoCo(Replicas):
    """DiLoCo (Douillard et al., 2023): ``sync_every`` inner steps of the user's optimizer per replica, then one
    bucketed all-reduce of the pseudo-gradients θ−θᵢ and the outer optimizer (``transpile(outer_optimizer=...)``,
    the paper's Nesterov SGD at lr 0.7 by default) on the global weights."""

    names = (
        ModeName(
            "diloco",
            "DiLoCo: H local steps of the inner optimizer, then an outer optimizer on the averaged pseudo-gradients",
        ),
    )
    bucket_cap_mb: float = knob(25.0, of="diloco-outer-step")
    first_bucket_mb: float = knob(1.0, of="diloco-outer-step")

    def recipe(self) -> Recipe:
        caps = {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_mb": self.first_bucket_mb}
        sync = passes.DiLoCoOuterStep(**caps, offload_global=self.offload_global, axis=self.axis)
        return self.replicas({"inner": [], "sync": [sync]}, caps, DiLoCoSchedule(self.sync_every), ())


@dataclass(frozen=True, kw_only=True, repr=False)
class StreamingDiLoCo(Replicas):
    """Streaming DiLoCo (Douillard et al., 2025): the parameters cut into ``fragments`` of whole modules that sync
    in turn, each exchange overlapping ``fragment_sync_delay`` inner steps, mixed with ``fragment_update_alpha``,
    sent as ``exchange_dtype`` and summed in float32."""

    names = (
        ModeName(
            "streaming_diloco",
            "Streaming DiLoCo: fragments sync in turn, each exchange overlapping inner steps, low-precision wire",
        ),
    )
    sync_every: int = own(100, minimum=1, help="inner steps between two syncs of a fragment (H)")
    fragments: int = knob(4, of="diloco-outer-step")
    fragment_sync_delay: int = own(
        0, minimum=0, help="inner steps between starting a fragment's exchange and applying it (τ)"
    )
    fragment_update_alpha: float = knob(0.0, of="diloco-outer-step")
    exchange_dtype: str = knob("float32", of="diloco-outer-step")

    def check(self) -> None:
        StreamingDiLoCoSchedule(self.sync_every, self.fragments, self.fragment_sync_delay)  # checks the three

    def refusal(self, surroundings: Surroundings) -> str | None:
        if surroundings.quorum_group is not None:
            if self.fragment_sync_delay:
                return not_under_quorum(
                    "fragment_sync_delay", "leaves a fragment's exchange in flight from one step to a later one"
                )
            if self.exchange_dtype != "float32":
                return not_under_quorum(
                    "exchange_dtype", "sends each group's share of the sum to one rank of a fixed world (all-to-all)"
                )
        return super().refusal(surroundings)

    def recipe(self) -> Recipe:
        schedule = StreamingDiLoCoSchedule(self.sync_every, self.fragments, self.fragment_sync_delay)
        common = {
            "fragments": self.fragments,
            "fragment_update_alpha": self.fragment_update_alpha,
            "exchange_dtype": self.exchange_dtype,
            "offload_global": self.offload_global,
            "axis": self.axis,
        }
        body: dict[str, list[Pass]] = {"inner": []}
        for p in range(self.fragments):
            phase = "start" if self.fragment_sync_delay else "whole"
            body[f"sync{p}"] = [passes.DiLoCoOuterStep(fragment=p, phase=phase, **common)]
            if self.fragment_sync_delay:
                body[f"apply{p}"] = [passes.DiLoCoOuterStep(fragment=p, phase="finish", **common)]
        return self.replicas(body, {}, schedule, (STREAMING_OUTER_SGD,))


@dataclass(frozen=True, kw_only=True, repr=False)
class SparseLoCo(Replicas):
    """SparseLoCo (Sarfi et al., 2025), as its authors' code runs it: DiLoCo's rounds, each replica's Δ added at lr
    ``outer_lr`` into an error buffer whose top-k entries per tile are sent, quantised per tensor; the outer step is
    plain SGD at lr ``outer_lr`` on their mean over the replicas that sent each entry."""

    names = (
        ModeName(
            "sparseloco",
            "SparseLoCo: DiLoCo rounds sending the top-k of each tile of an error buffer, quantised; outer SGD",
        ),
    )
    sync_every: int = own(15, minimum=1, help="inner steps per outer round (H)")
    outer_lr: float = knob(1.0, of="diloco-outer-step")
    error_decay: float = knob(0.95, of="diloco-outer-step")
    chunk_size: int = knob(64, of="diloco-outer-step")
    topk: int = knob(128, of="diloco-outer-step", minimum=1)
    quantization_bins: int = knob(4, of="diloco-outer-step")
    quantization_range: float = knob(6.0, of="diloco-outer-step")

    def recipe(self) -> Recipe:
        sparse = {
            name: getattr(self, name)
            for name in ("topk", "chunk_size", "quantization_bins", "quantization_range", "error_decay", "outer_lr")
        }
        sync = passes.DiLoCoOuterStep(**sparse, offload_global=self.offload_global, axis=self.axis)
        recipe = self.replicas({"inner": [], "sync": [sync]}, {}, DiLoCoSchedule(self.sync_every), ())
        outer_sgd = OuterSGD(lr=self.outer_lr, momentum=0.0, nesterov=False, fixed=True)
        return dataclasses.replace(recipe, outer_sgd=outer_sgd)
