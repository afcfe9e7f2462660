"""The rewrite passes, one per module, with their shared helpers. ``PASSES`` (``registry.py``) names them.

A pass builds on ``transpiler.graph`` (and ``transpiler.errors``) only. Importing any of it enters through the
``transpiler`` package root first, on the line below, so the package loads top-down whichever module is
imported first: ``transpiler`` → ``api`` → ``strategies`` → the pass modules → ``transpiler.graph``. Without it,
``import passes.fuse_allreduce`` would start the pass, whose ``transpiler.graph`` import runs the ``transpiler``
root, whose strategies would then need the pass it is still waiting on (docs/design.md#layers).
"""

import transpiler  # noqa: F401  (load order only: nothing of it is used here)

from .registry import (
    PASSES,
    AccumulateGrads,
    AdaSum,
    AllGatherGrads,
    AllReduceGrads,
    BroadcastParams,
    ClipGradNorm,
    DiLoCoOuterStep,
    DimReduce,
    FlattenUpdate,
    ForeachUpdate,
    FreezeGroups,
    FuseAllReduce,
    GatherParams,
    LocalSGDAverage,
    LossScale,
    PartialAverage,
    ReinplaceOptimizer,
    ScaleLossGrad,
    ScheduleCollectives,
    ShardOptimizer,
    ShardParams,
    SparseAllReduce,
)

__all__ = [
    "PASSES",
    "AccumulateGrads",
    "AdaSum",
    "AllGatherGrads",
    "AllReduceGrads",
    "BroadcastParams",
    "ClipGradNorm",
    "DiLoCoOuterStep",
    "DimReduce",
    "FlattenUpdate",
    "ForeachUpdate",
    "FreezeGroups",
    "FuseAllReduce",
    "GatherParams",
    "LocalSGDAverage",
    "LossScale",
    "PartialAverage",
    "ReinplaceOptimizer",
    "ScaleLossGrad",
    "ScheduleCollectives",
    "ShardOptimizer",
    "ShardParams",
    "SparseAllReduce",
]
