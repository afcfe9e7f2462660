"""Which process group a step's collectives use, and the private one-rank group.

With torchrun, the collectives run on torch.distributed's default group, or,
with an explicit ``timeout=``, on a group over all ranks created with that
timeout. Every group created here takes the same timeout, so a stalled rank
makes the others fail within it. A world-size-1 run needs no
``init_process_group``: its graphs name a private single-rank gloo group,
registered here, on which every collective is an identity, so the same
rewritten graph runs everywhere. Under torchrun (``WORLD_SIZE`` > 1) a missing
``init_process_group`` is an error, never a silent world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _register_process_group

from transpiler.errors import ConfigurationError
from transpiler.graph.config import Config, own
from transpiler.graph.program import Axis

LOCAL_GROUP = "transpiler-local"
STATIC_GROUP = "world"  # named in graphs built with world_size>1 and no process group (CLI, static checks)
_local_group: ProcessGroup | None = None  # the registry keeps only a weak reference


TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo (and NCCL without blocking wait)


@dataclass(frozen=True, kw_only=True, repr=False)
class StaticWorld(Config):
    """``transpile(..., mesh=StaticWorld(size=4, rank=1))``: build rank ``rank``'s programs of a world of ``size``
    without a process group, to look at them (``transpiler dump``, a test's static checks); such a step cannot
    run. Under torchrun leave it out: the process group gives the world."""

    size: int = own(kind=int, minimum=1, help="ranks in the world")
    rank: int = own(0, minimum=0, help="the rank whose programs are built")

    def check(self) -> None:
        if self.rank >= self.size:
            raise ConfigurationError(f"rank {self.rank} is outside the world of size {self.size}.")


@dataclass(frozen=True)
class Placement:
    world_size: int
    rank: int
    group_name: str
    live: bool  # a step built for this placement can run
    timeout: timedelta = TORCH_DEFAULT_TIMEOUT  # of every group the step's collectives use


def group_timeout(group: ProcessGroup) -> timedelta:
    """The timeout a process group was created with (its backend's option), or torch's default."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return TORCH_DEFAULT_TIMEOUT


def live_group(placement: Placement) -> ProcessGroup | None:
    """The process group over all ranks that ``placement``'s collectives run on (with its timeout), for the
    collectives a step runs outside its graphs; None when there is no torch.distributed world to run them in."""
    if not dist.is_initialized() or placement.group_name in (LOCAL_GROUP, STATIC_GROUP):
        return None
    return dist.distributed_c10d._resolve_process_group(placement.group_name)


def require_live(placement: Placement) -> None:
    """Before anything runs a program's collectives: an error for a step built without a process group, and the
    private one-rank group registered where the step uses it."""
    if not placement.live:
        raise ConfigurationError(
            f"this step was built for world_size={placement.world_size} without a process group, "
            "so it can be inspected but not run. Launch with torchrun and call "
            "torch.distributed.init_process_group(...) before transpile()."
        )
    if placement.group_name == LOCAL_GROUP:
        ensure_local_group()


def ensure_local_group() -> None:
    """The private one-rank group, made once per process and registered again whenever the registry lost it:
    ``destroy_process_group()`` (a world of its own that the process made and ended between two steps, as a
    script that calls ``main()`` twice does) clears every registered name, this one too."""
    global _local_group
    if _local_group is None:
        store = dist.HashStore()
        backend = dist.ProcessGroupGloo(store, 0, 1)
        group = ProcessGroup(store, 0, 1)
        group._set_default_backend(ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
        _local_group = group
    try:
        dist.distributed_c10d._resolve_process_group(LOCAL_GROUP)
    except (RuntimeError, ValueError, KeyError):
        _register_process_group(LOCAL_GROUP, _local_group)


def resolve_placement(world_size: int | None, rank: int | None, timeout: timedelta | None = None) -> Placement:
    """Combine explicit ``world_size``/``rank``/``timeout`` with torch.distributed's state."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigurationError(f"{name} must be an int, got {value!r}.")
    if world_size is not None and world_size < 1:
        raise ConfigurationError(f"world_size must be >= 1, got {world_size}.")
    live = dist.is_available() and dist.is_initialized()
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not live and world_size is None and launched > 1:
        raise ConfigurationError(
            f"WORLD_SIZE={launched} in the environment (torchrun?) but no default process group: every rank would "
            "train alone. Call torch.distributed.init_process_group('gloo') (or 'nccl' on GPUs) before transpile(); "
            "pass world_size=/rank= only to inspect a program without running it."
        )
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
        if timeout is None:
            return Placement(actual_w, actual_r, dist.group.WORLD.group_name, True, group_timeout(dist.group.WORLD))
        return Placement(actual_w, actual_r, _world_group(actual_w, timeout), True, timeout)
    local_timeout = timeout or TORCH_DEFAULT_TIMEOUT
    if world_size in (None, 1):
        return Placement(1, 0, LOCAL_GROUP, True, local_timeout)
    return Placement(world_size, rank or 0, STATIC_GROUP, False, local_timeout)


def mesh_placement(mesh: object, timeout: timedelta | None) -> Placement:
    """The placement of a mode across one dimension of a device mesh (``transpile(mesh=mesh["dp"])``, beside a
    tensor-parallel plan on the other): its size, this rank's place in it, its group and that group's timeout."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        raise ConfigurationError(
            "the model's parameters are DTensors (a tensor-parallel plan): give transpile() the mesh dimension the "
            "mode spans, mesh=mesh['dp'] of a ('dp', 'tp') mesh (a mesh of size 1 where all ranks are one TP group)."
        )
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ConfigurationError(
            f"mesh must be a 1-D torch DeviceMesh, the dimension the mode spans (mesh['dp']); got "
            f"{type(mesh).__name__}{f' with {mesh.ndim} dimensions' if isinstance(mesh, DeviceMesh) else ''}."
        )
    if timeout is not None:
        raise ConfigurationError(
            "with a device mesh, leave Execution.timeout out: the mesh's groups take the timeout given to "
            "torch.distributed.init_process_group()."
        )
    group = mesh.get_group()
    size = mesh.size()
    if size == 1:
        return Placement(1, 0, LOCAL_GROUP, True, group_timeout(group))
    return Placement(size, mesh.get_local_rank(), group.group_name, True, group_timeout(group))


def pipeline_placement(
    stages: int, size: int | None, rank: int | None, timeout: timedelta | None
) -> tuple[Placement, Axis]:
    """A pipeline over the whole world (its size must be ``stages``; ``size``/``rank``: a static world's): the
    mode's placement, a world of one (each stage alone holds its parameters), and the axis 'pp', whose rank is
    this rank's stage."""
    world = resolve_placement(size, rank, timeout)
    if world.world_size != stages:
        raise ConfigurationError(
            f"a pipeline of {stages} stages runs on {stages} ranks, one per stage; the world has "
            f"{world.world_size}. Launch {stages} processes (torchrun --nproc-per-node {stages}), or set stages="
            f"{world.world_size}."
        )
    group = LOCAL_GROUP if world.live else STATIC_GROUP
    return Placement(1, 0, group, world.live, world.timeout), Axis(stages, world.rank, world.group_name)


def pipeline_mesh_placement(stages: int, mesh: object, timeout: timedelta | None) -> tuple[Placement, Axis]:
    """A pipeline on the dimension ``pp`` of a device mesh, the mode across its dimension ``dp`` (if it has one):
    the mode's placement and the axis 'pp' (this rank's stage, the pipeline's group)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names or not set(names) <= {"pp", "dp"}:
        raise ConfigurationError(
            f"beside a pipeline, mesh must be a DeviceMesh whose dimensions are named 'pp' and (for the mode's "
            f"data parallel) 'dp', as init_device_mesh(..., mesh_dim_names=('pp', 'dp')) makes (beside a "
            f"tensor-parallel plan, mesh['pp', 'dp'] of a ('pp', 'dp', 'tp') mesh); got {names}."
        )
    pp = mesh["pp"]
    if pp.size() != stages:
        raise ConfigurationError(f"the mesh's 'pp' dimension has {pp.size()} ranks and the pipeline {stages} stages.")
    axis = Axis(stages, pp.get_local_rank(), pp.get_group().group_name)
    if "dp" not in names:
        return Placement(1, 0, LOCAL_GROUP, True, group_timeout(pp.get_group())), axis
    return mesh_placement(mesh["dp"], timeout), axis


_subgroups: dict[tuple[tuple[int, ...], timedelta], str] = {}


def _world_group(world: int, timeout: timedelta) -> str:
    """A group over all ranks with its own timeout (created once per timeout, on every rank)."""
    key = (tuple(range(world)), timeout)
    if key not in _subgroups:
        _subgroups[key] = dist.new_group(list(range(world)), timeout=timeout).group_name
    return _subgroups[key]


def subgroup_names(placement: Placement, groups: list[tuple[int, ...]]) -> dict[tuple[int, ...], str]:
    """Process-group names for the rank subsets a strategy needs.

    With a live process group every rank creates every subgroup, in the given
    order, as ``new_group`` requires (cached per process and timeout, each with
    the placement's timeout); without one, the names only label the static graphs.
    """
    labels = {ranks: "ranks:" + ",".join(map(str, ranks)) for ranks in groups}
    if not placement.live or placement.world_size == 1:
        return labels
    for ranks in groups:
        key = (ranks, placement.timeout)
        if key not in _subgroups:
            group = dist.new_group(list(ranks), timeout=placement.timeout)
            # a rank outside the group gets a sentinel, not a group: its graphs never name that group
            _subgroups[key] = group.group_name if isinstance(group, dist.ProcessGroup) else labels[ranks]
    return {ranks: _subgroups[(ranks, placement.timeout)] for ranks in groups}
