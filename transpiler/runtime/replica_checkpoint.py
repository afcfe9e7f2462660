"""DCP checkpoints of DiLoCo's steps, whose replicas hold different weights and inner optimizer state between
syncs, written so that a job resumes at the same or at another number of replicas.

What every rank holds alike is written once: θ_global as the checkpoint's ``model`` (so a plain model that
reads it with ``dcp.load({"model": model.state_dict()}, ...)`` gets the global weights, which the paper
evaluates), the outer optimizer's state (``outer``), the inner optimizer's param groups (``optim``) and the
schedule. What each replica holds alone (its weights, its inner optimizer's state, its loss scale) is one tensor
of shape ``[N, *shape]`` per entry under ``replicas``, row ``j`` replica ``j``'s: the replica's first rank writes
its row, or under ``replica_mode=zero*`` each rank its slice of the inner state (boxes, as
:func:`sharded_checkpoint.sharded` cuts them).

Read back by ``N'`` replicas, replica ``j`` continues saved replica ``j mod N``: at the same count every replica
resumes bitwise, and at another the extra replicas start as copies of saved ones (as torchft heals a replica
from a peer) and drop the rest; each rank reads only its row (its slice of it), never the ``[N, ...]`` whole.
A Streaming DiLoCo exchange in flight is never saved: it was summed over the old world, and under a quantised
exchange it is per rank (the ``Checkpointer`` waits for it to land).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from transpiler.errors import CheckpointError

from . import sharded_checkpoint
from .sharded_checkpoint import (
    Ranks,
    SlicePlanner,
    box_views,
    empty_like_entry,
    load_optimizer,
    named_param_groups,
    put_at,
    sharded,
)
from .sharded_params import held_slice
from .step_state import parameter_names

Bounds = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Replica:
    """This rank's replica: how many there are, which is this rank's, and this rank's place in it."""

    count: int
    index: int
    position: int

    @classmethod
    def of(cls, rank: int, world: int, replica_ranks: tuple[int, ...]) -> Replica:
        size = len(replica_ranks)  # consecutive ranks (ReplicaLayout)
        return cls(world // size, rank // size, replica_ranks.index(rank))


@dataclass
class Loaded:
    """What a read gives back beside what it put in place: θ_global, the per-replica extra state, the schedule."""

    global_params: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    schedule: dict[str, Any]


def save(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: torch.optim.Optimizer,
    global_params: dict[str, torch.Tensor],
    extra: dict[str, torch.Tensor],
    transpiler: dict[str, Any],
    shards: Bounds,
    replica: Replica,
    ranks: Ranks,
) -> None:
    """Write the checkpoint; every rank calls it (``shards``: this rank's slices of the inner state, under
    ``replica_mode=zero*``)."""
    names = parameter_names(model)
    shapes = {name: p.shape for name, p in model.named_parameters()}

    def rows(value: torch.Tensor, shape: torch.Size, bounds: tuple[int, int] | None) -> Any:
        if ranks.world == 1:  # one replica, one rank: its row is all there is (and there may be no process group)
            return value.reshape(1, *shape)
        numel = math.prod(shape)
        if bounds is None:  # the replica's first rank writes the whole row
            flat, lo = value.reshape(-1)[: numel if replica.position == 0 else 0], 0
        else:
            flat, lo = held_slice(value, numel, bounds), bounds[0]
        return sharded(flat, torch.Size([replica.count, *shape]), replica.index * numel + lo, ranks)

    params = {name: rows(p.detach(), p.shape, None) for name, p in model.named_parameters()}
    inner: dict[str, dict[str, Any]] = {}
    for param, entries in optimizer.state.items():
        name = names[id(param)]
        inner[name] = {}
        for key, value in entries.items():
            if torch.is_tensor(value):
                sliced = shards.get(name) if value.dim() > 0 else None
                value = rows(value, shapes[name] if sliced else value.shape, sliced)
            inner[name][key] = value
    # θ_global under every name of a parameter (tied ones too); buffers and frozen parameters as they are
    entries = model.state_dict(keep_vars=True).items()
    state = {
        "model": {k: global_params.get(names.get(id(v), ""), v).detach() for k, v in entries},
        "optim": {"param_groups": named_param_groups(optimizer, names)},
        "outer": {
            "state": {names[id(p)]: dict(s) for p, s in outer.state.items()},
            "param_groups": named_param_groups(outer, names),
        },
        "replicas": {
            "model": params,
            "optim": inner,
            "extra": {k: rows(v, v.shape, None) for k, v in extra.items()},
        },
        "transpiler": transpiler,
    }
    sharded_checkpoint.save(state, path, ranks)


class RowPlanner(SlicePlanner):
    """DCP's load planner that also reads boxes of saved tensors straight into given views: ``boxes[key]`` lists
    ``(offsets, view)`` for the checkpoint's (flattened) key."""

    def __init__(self, boxes: dict[str, list[tuple[list[int], torch.Tensor]]]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = [
            item
            for key, views in self.boxes.items()
            for item in create_read_items_for_chunk_list(
                key,
                self.metadata.state_dict_metadata[key],
                [ChunkStorageMetadata(torch.Size(offsets), view.shape) for offsets, view in views],
            )
        ]
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.boxes:
            return self.boxes[index.fqn][index.index][1]
        return super().lookup_tensor(index)


def _row_boxes(target: torch.Tensor, saved: torch.Size, row: int, lo: int) -> list[tuple[list[int], torch.Tensor]]:
    """Boxes of the saved ``[N, *shape]`` tensor that fill ``target`` (row ``row``'s elements from ``lo`` on)."""
    return box_views(target.reshape(-1), saved, row * math.prod(saved[1:]) + lo)


def load(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: torch.optim.Optimizer,
    shards: Bounds | None,
    replica: Replica,
    ranks: Ranks,
) -> Loaded:
    """Read the checkpoint at ``path`` into this replica's model and inner optimizer (from saved replica
    ``index mod N``) and into the outer optimizer; returns θ_global, the replica's extra state and the schedule.
    ``shards``: this rank's slices of the inner state (None before the step is built: whole rows, cut at the
    first step)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    names = parameter_names(model)
    by_name = dict(model.named_parameters())
    counts = {
        entry.size[0]
        for key, entry in metadata.state_dict_metadata.items()
        if metadata.planner_data[key][0] == "replicas" and isinstance(entry, TensorStorageMetadata)
    }
    if len(counts) != 1:
        raise CheckpointError(f"'{path}' holds no per-replica rows: step.save_checkpoint() of a DiLoCo step wrote it?")
    row = replica.index % counts.pop()
    device = next(model.parameters()).device
    buffers = dict(model.named_buffers())
    template: dict[str, Any] = {"model": {}, "outer": {}, "optim": {}, "transpiler": {}}
    boxes: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    inner: dict[str, dict[str, Any]] = {}
    extra: dict[str, torch.Tensor] = {}
    global_params: dict[str, torch.Tensor] = {}
    for key, path_of in metadata.planner_data.items():
        entry = metadata.state_dict_metadata[key]
        head = path_of[0]
        if head == "model":  # θ_global of each trainable parameter (a replica's own weights are rows); buffers
            name = path_of[1]
            if name in by_name and by_name[name].requires_grad:
                global_params[name] = template["model"][name] = torch.empty_like(by_name[name].detach())
            elif name in buffers:
                template["model"][name] = buffers[name]  # read in place
        elif head in ("outer", "optim", "transpiler"):
            if path_of[1] != "param_groups":  # in the optimizers' own layout, below
                put_at(template, path_of, empty_like_entry(entry))
        elif not isinstance(entry, TensorStorageMetadata):  # an object in a replica's inner state
            put_at(template, path_of, None)
        else:
            saved = torch.Size(entry.size)
            kind, name = path_of[1], path_of[2]
            if kind == "model":
                if name not in by_name or tuple(saved[1:]) != tuple(by_name[name].shape):
                    raise CheckpointError(
                        f"the checkpoint's replica weights '{name}' {list(saved[1:])} do not fit this model."
                    )
                boxes[key] = _row_boxes(by_name[name].detach(), saved, row, 0)
            elif kind == "extra":
                extra[name] = torch.empty(saved[1:], dtype=entry.properties.dtype, device=device)
                boxes[key] = _row_boxes(extra[name], saved, row, 0)
            else:
                bounds = shards.get(name) if shards and len(saved) > 1 else None
                lo, hi = bounds if bounds is not None else (0, math.prod(saved[1:]))
                target = torch.empty(hi - lo, dtype=entry.properties.dtype, device=by_name[name].device)
                boxes[key] = _row_boxes(target, saved, row, lo)
                inner.setdefault(name, {})[path_of[3]] = target if bounds else target.view(saved[1:])
    missing = sorted(n for n, p in by_name.items() if p.requires_grad and n not in global_params)
    missing += sorted(n for n in by_name if f"replicas.model.{n}" not in boxes)
    if missing:
        raise CheckpointError(f"the checkpoint holds no weights for {missing[:4]}: it was written for another model.")
    template["optim"]["param_groups"] = named_param_groups(optimizer, names)
    template["outer"]["param_groups"] = named_param_groups(outer, names)
    sharded_checkpoint.load({k: v for k, v in template.items() if v}, path, ranks, RowPlanner(boxes))
    for name, entries in template.get("replicas", {}).get("optim", {}).items():
        inner.setdefault(name, {}).update(entries)  # objects of the inner state
    load_optimizer(optimizer, names, inner, template["optim"]["param_groups"])
    load_optimizer(outer, names, template["outer"].get("state", {}), template["outer"]["param_groups"])
    return Loaded(global_params, extra, template["transpiler"].get("schedule", {}))
