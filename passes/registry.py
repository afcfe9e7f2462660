"""The registry of passes: the name a pipeline spec uses, to the module and class that implement it.

A pass module loads when its name is first looked up, as xDSL's registry does (``get_all_passes``): importing
the registry, or the ``passes`` package, loads none of them, so nothing here waits on the ``transpiler`` package
while it loads, and whichever module of either package a user imports first, the import graph has no cycle
(docs/design.md#layers). The order is the one ``transpiler passes`` lists, the order a pipeline runs them in.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transpiler.graph.pipeline import Pass

WHERE = {
    "split-stages": "split_stages:SplitStages",
    "recompute": "recompute:Recompute",
    "broadcast-params": "broadcast_params:BroadcastParams",
    "freeze-groups": "freeze_groups:FreezeGroups",
    "scale-loss-grad": "scale_loss_grad:ScaleLossGrad",
    "accumulate-grads": "accumulate_grads:AccumulateGrads",
    "adasum": "adasum:AdaSum",
    "allreduce-grads": "allreduce_grads:AllReduceGrads",
    "fuse-allreduce": "fuse_allreduce:FuseAllReduce",
    "sparse-allreduce": "sparse_allreduce:SparseAllReduce",
    "demo-exchange": "demo_exchange:DeMoExchange",
    "allgather-grads": "allgather_grads:AllGatherGrads",
    "shard-optimizer": "shard_optimizer:ShardOptimizer",
    "local-sgd-average": "local_sgd:LocalSGDAverage",
    "diloco-outer-step": "diloco_outer_step:DiLoCoOuterStep",
    "partial-average": "partial_average:PartialAverage",
    "loss-scale": "loss_scale:LossScale",
    "clip-grad-norm": "clip_grad_norm:ClipGradNorm",
    "gather-params": "gather_params:GatherParams",
    "shard-params": "shard_params:ShardParams",
    "dim-reduce": "dim_reduce:DimReduce",
    "flatten-update": "flatten_update:FlattenUpdate",
    "foreach-update": "foreach_update:ForeachUpdate",
    "schedule-collectives": "schedule_collectives:ScheduleCollectives",
    "overlap-quorum": "overlap_quorum:OverlapQuorum",
    "reinplace-optimizer": "reinplace_optimizer:ReinplaceOptimizer",
}


class PassRegistry(Mapping[str, "type[Pass]"]):
    """Pass classes by name, each module imported on its first lookup."""

    def __init__(self, where: dict[str, str]) -> None:
        self._where = where
        self._loaded: dict[str, type[Pass]] = {}

    def __getitem__(self, name: str) -> type[Pass]:
        cls = self._loaded.get(name)
        if cls is None:
            module, _, attribute = self._where[name].partition(":")
            cls = self._loaded[name] = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


PASSES = PassRegistry(WHERE)
