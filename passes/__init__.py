"""The rewrite passes, one per module, with their shared helpers. ``PASSES`` (``registry.py``) names them:
``PASSES["fuse-allreduce"]`` is that pass's class, its module loaded when it is first looked up. A pass is also
here by its class's name (``from passes import FuseAllReduce``), looked up in the registry the same way.

A pass builds on ``transpiler.graph`` (and ``transpiler.errors``) only (docs/design.md#layers). Importing this
package loads no pass, and the ``transpiler`` package loads none while it loads: so either may be imported
first, and neither waits on the other half-loaded. The strategies build their pipelines from these names
(``passes.FuseAllReduce(bucket_cap_mb=...)``), so a config's field leads to the pass that reads it by going to
the definition; the imports below only serve that, and never run.
"""

from typing import TYPE_CHECKING

from .registry import PASSES, WHERE

if TYPE_CHECKING:  # for readers and IDEs: ``passes.FuseAllReduce`` leads to its class (tests/test_layers.py)
    from .accumulate_grads import AccumulateGrads as AccumulateGrads
    from .adasum import AdaSum as AdaSum
    from .allgather_grads import AllGatherGrads as AllGatherGrads
    from .allreduce_grads import AllReduceGrads as AllReduceGrads
    from .broadcast_params import BroadcastParams as BroadcastParams
    from .clip_grad_norm import ClipGradNorm as ClipGradNorm
    from .demo_exchange import DeMoExchange as DeMoExchange
    from .diloco_outer_step import DiLoCoOuterStep as DiLoCoOuterStep
    from .dim_reduce import DimReduce as DimReduce
    from .flatten_update import FlattenUpdate as FlattenUpdate
    from .foreach_update import ForeachUpdate as ForeachUpdate
    from .freeze_groups import FreezeGroups as FreezeGroups
    from .fuse_allreduce import FuseAllReduce as FuseAllReduce
    from .gather_params import GatherParams as GatherParams
    from .local_sgd import LocalSGDAverage as LocalSGDAverage
    from .loss_scale import LossScale as LossScale
    from .overlap_quorum import OverlapQuorum as OverlapQuorum
    from .partial_average import PartialAverage as PartialAverage
    from .recompute import Recompute as Recompute
    from .reinplace_optimizer import ReinplaceOptimizer as ReinplaceOptimizer
    from .scale_loss_grad import ScaleLossGrad as ScaleLossGrad
    from .schedule_collectives import ScheduleCollectives as ScheduleCollectives
    from .shard_optimizer import ShardOptimizer as ShardOptimizer
    from .shard_params import ShardParams as ShardParams
    from .sparse_allreduce import SparseAllReduce as SparseAllReduce
    from .split_stages import SplitStages as SplitStages

_CLASSES = {where.partition(":")[2]: name for name, where in WHERE.items()}  # class name -> pass name

__all__ = ["PASSES", *_CLASSES]


def __getattr__(attribute: str) -> type:
    """A pass class by its own name, from the registry (which loads its module)."""
    if attribute in _CLASSES:
        return PASSES[_CLASSES[attribute]]
    raise AttributeError(f"module 'passes' has no attribute '{attribute}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CLASSES})
