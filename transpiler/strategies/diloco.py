"""The recipes of DiLoCo and Streaming DiLoCo: H inner steps of the user's optimizer on each replica, then an outer
optimizer on the averaged pseudo-gradients; each replica one rank, or R ranks in data parallel (HSDP's layout)."""

from __future__ import annotations

import dataclasses

from transpiler.errors import ConfigurationError
from transpiler.graph.pipeline import Pass
from transpiler.graph.rank_layouts import ReplicaLayout

from .checks import STREAMING_OUTER_SGD, Elementwise
from .data_parallel import prefix
from .options import make
from .schedules import DiLoCoSchedule, Schedule, StreamingDiLoCoSchedule
from .strategy import OptimizerCheck, OuterSGD, Recipe


def diloco(
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
    axis = "across" if replica_size > 1 else "world"
    body = {"inner": [], "sync": [make("diloco-outer-step", **caps, offload=offload_global, axis=axis)]}
    return _replicas(replica_size, replica_mode, body, caps, DiLoCoSchedule(sync_every), ())


def sparseloco(
    sync_every: int,
    outer_lr: float,
    error_decay: float,
    chunk_size: int,
    topk: int,
    quantization_bins: int,
    quantization_range: float,
    replica_size: int,
    replica_mode: str,
    offload_global: bool,
) -> Recipe:
    """SparseLoCo (Sarfi et al., 2025), as its authors' code runs it: DiLoCo's rounds, each replica's Δ added at lr
    ``outer_lr`` into an error buffer whose top-k entries per tile are sent, quantised per tensor; the outer step
    is plain SGD at lr ``outer_lr`` on their mean over the replicas that sent each entry."""
    axis = "across" if replica_size > 1 else "world"
    sparse = {
        "topk": topk,
        "chunk": chunk_size,
        "bins": quantization_bins,
        "sigmas": quantization_range,
        "error_decay": error_decay,
        "error_lr": outer_lr,
    }
    body = {"inner": [], "sync": [make("diloco-outer-step", **sparse, offload=offload_global, axis=axis)]}
    recipe = _replicas(replica_size, replica_mode, body, {}, DiLoCoSchedule(sync_every), ())
    return dataclasses.replace(recipe, outer_sgd=OuterSGD(lr=outer_lr, momentum=0.0, nesterov=False, fixed=True))


def streaming_diloco(
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
        body[f"sync{p}"] = [make("diloco-outer-step", fragment=p, phase=phase, **common)]
        if fragment_sync_delay:
            body[f"apply{p}"] = [make("diloco-outer-step", fragment=p, phase="finish", **common)]
    return _replicas(replica_size, replica_mode, body, {}, schedule, (STREAMING_OUTER_SGD,))


def _replicas(
    size: int,
    inside: str,
    body: dict[str, list[Pass]],
    caps: dict,
    schedule: Schedule,
    outer: tuple[OptimizerCheck, ...],
) -> Recipe:
    """A DiLoCo recipe: each variant's ``body``, after data parallel inside replicas of ``size`` ranks (none when
    each rank is its own replica), by ``inside``: ``fused_allreduce``, or ZeRO-1/2 over the replica's ranks (the
    inner optimizer's state sharded, the updated parameters gathered whole before the outer step reads them)."""
    seed: list[Pass] = []
    micro_tail: list[Pass] | None = None
    micro_body: list[Pass] | None = None
    checks: tuple[OptimizerCheck, ...] = ()
    if size == 1 and inside != "fused_allreduce":
        raise ConfigurationError(
            f"replica_mode='{inside}' shards each replica's optimizer state over its ranks, and replica_size=1 "
            "makes every rank its own replica: give replica_size=R (R ranks per replica), or drop replica_mode."
        )
    if size > 1:
        seed = [make("scale-loss-grad", axis="replica")]
        if inside == "fused_allreduce":
            inner: list[Pass] = [make("fuse-allreduce", axis="replica", **caps)]
        else:
            stage = int(inside.removeprefix("zero"))
            shard = make("shard-optimizer", axis="replica", keep_gradient_buckets=stage == 1, **caps)
            inner = [shard, make("gather-params", axis="replica")]
            checks = (Elementwise(f"diloco with replica_mode='{inside}'"),)
            if stage == 2:  # micro-steps reduce-scatter into this rank's slices, as zero2's
                micro_body, micro_tail = [shard], [make("schedule-collectives")]
        body = {v: [*inner, *passes] for v, passes in body.items()}
    return Recipe(
        body,
        prefix(),
        seed,
        tail=[make("foreach-update"), make("schedule-collectives"), make("reinplace-optimizer")],
        schedule=schedule,
        layout=ReplicaLayout(size),
        checks=checks,
        micro_tail=micro_tail,
        micro_body=micro_body,
        gradient_axis="replica" if size > 1 else "world",
        outer=outer,
    )
