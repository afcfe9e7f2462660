"""Rewrite passes, one per module. ``PASSES`` is the registry, listed by hand."""

from transpiler.pipeline import Pass

from .adasum import AdaSum
from .allreduce_grads import AllReduceGrads
from .broadcast_params import BroadcastParams
from .fuse_allreduce import FuseAllReduce
from .local_sgd import LocalSGDAverage
from .reinplace_optimizer import ReinplaceOptimizer
from .scale_loss_grad import ScaleLossGrad
from .schedule_collectives import ScheduleCollectives

PASSES: dict[str, type[Pass]] = {
    cls.name: cls
    for cls in (
        BroadcastParams,
        ScaleLossGrad,
        AdaSum,
        AllReduceGrads,
        FuseAllReduce,
        LocalSGDAverage,
        ScheduleCollectives,
        ReinplaceOptimizer,
    )
}

__all__ = [
    "PASSES",
    "AdaSum",
    "AllReduceGrads",
    "BroadcastParams",
    "FuseAllReduce",
    "LocalSGDAverage",
    "ReinplaceOptimizer",
    "ScaleLossGrad",
    "ScheduleCollectives",
]
