"""Which process group a step's collectives use, and the private one-rank group.

With torchrun, the collectives run on torch.distributed's default group. A
world-size-1 run needs no ``init_process_group``: its graphs name a private
single-rank gloo group, registered here, on which every collective is an
identity, so the same rewritten graph runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _register_process_group

from .errors import ConfigurationError

LOCAL_GROUP = "transpiler-local"
STATIC_GROUP = "world"  # named in graphs built with world_size>1 and no process group (CLI, static checks)
_local_group: ProcessGroup | None = None  # the registry keeps only a weak reference


@dataclass(frozen=True)
class Placement:
    world_size: int
    rank: int
    group_name: str
    live: bool  # a step built for this placement can run


def ensure_local_group() -> None:
    global _local_group
    if _local_group is not None:
        return
    store = dist.HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1)
    group = ProcessGroup(store, 0, 1)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    _register_process_group(LOCAL_GROUP, group)
    _local_group = group


def resolve_placement(world_size: int | None, rank: int | None) -> Placement:
    """Combine explicit ``world_size``/``rank`` with torch.distributed's state."""
    if world_size is not None and world_size < 1:
        raise ConfigurationError(f"world_size must be >= 1, got {world_size}.")
    live = dist.is_available() and dist.is_initialized()
    size = dist.get_world_size() if live else (world_size or 1)
    if rank is not None and not 0 <= rank < size:
        raise ConfigurationError(f"rank {rank} is outside the world of size {size}.")
    if live:
        actual_w, actual_r = dist.get_world_size(), dist.get_rank()
        if world_size not in (None, actual_w) or rank not in (None, actual_r):
            raise ConfigurationError(
                f"world_size={world_size}, rank={rank} disagree with the initialised process group "
                f"(world size {actual_w}, rank {actual_r}); leave them out under torchrun."
            )
        return Placement(actual_w, actual_r, dist.group.WORLD.group_name, True)
    if world_size in (None, 1):
        return Placement(1, 0, LOCAL_GROUP, True)
    return Placement(world_size, rank or 0, STATIC_GROUP, False)


SUBGROUP_TIMEOUT = timedelta(minutes=10)
_subgroups: dict[tuple[int, ...], str] = {}


def subgroup_names(placement: Placement, groups: list[tuple[int, ...]]) -> dict[tuple[int, ...], str]:
    """Process-group names for the rank subsets a strategy needs.

    With a live process group every rank creates every subgroup, in the given
    order, as ``new_group`` requires (cached per process, each with a timeout);
    without one, the names only label the static graphs.
    """
    labels = {ranks: "ranks:" + ",".join(map(str, ranks)) for ranks in groups}
    if not placement.live or placement.world_size == 1:
        return labels
    for ranks in groups:
        if ranks not in _subgroups:
            group = dist.new_group(list(ranks), timeout=SUBGROUP_TIMEOUT)
            # a rank outside the group gets a sentinel, not a group: its graphs never name that group
            _subgroups[ranks] = group.group_name if isinstance(group, dist.ProcessGroup) else labels[ranks]
    return {ranks: _subgroups[ranks] for ranks in groups}
