"""The registry of passes, listed by hand: the name a pipeline spec uses, to the pass's class.

Its own module, not ``passes/__init__.py``, because ``transpiler.strategies`` and ``transpiler.cli`` read it
while ``passes/__init__.py`` may still be waiting on the package root (docs/design.md#layers)."""

from transpiler.graph.pipeline import Pass

from .accumulate_grads import AccumulateGrads
from .adasum import AdaSum
from .allgather_grads import AllGatherGrads
from .allreduce_grads import AllReduceGrads
from .broadcast_params import BroadcastParams
from .clip_grad_norm import ClipGradNorm
from .diloco_outer_step import DiLoCoOuterStep
from .dim_reduce import DimReduce
from .flatten_update import FlattenUpdate
from .foreach_update import ForeachUpdate
from .freeze_groups import FreezeGroups
from .fuse_allreduce import FuseAllReduce
from .gather_params import GatherParams
from .local_sgd import LocalSGDAverage
from .loss_scale import LossScale
from .partial_average import PartialAverage
from .reinplace_optimizer import ReinplaceOptimizer
from .scale_loss_grad import ScaleLossGrad
from .schedule_collectives import ScheduleCollectives
from .shard_optimizer import ShardOptimizer
from .shard_params import ShardParams
from .sparse_allreduce import SparseAllReduce

PASSES: dict[str, type[Pass]] = {
    cls.name: cls
    for cls in (
        BroadcastParams,
        FreezeGroups,
        ScaleLossGrad,
        AccumulateGrads,
        AdaSum,
        AllReduceGrads,
        FuseAllReduce,
        SparseAllReduce,
        AllGatherGrads,
        ShardOptimizer,
        LocalSGDAverage,
        DiLoCoOuterStep,
        PartialAverage,
        LossScale,
        ClipGradNorm,
        GatherParams,
        ShardParams,
        DimReduce,
        FlattenUpdate,
        ForeachUpdate,
        ScheduleCollectives,
        ReinplaceOptimizer,
    )
}
