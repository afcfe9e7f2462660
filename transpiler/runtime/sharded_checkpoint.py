"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes what it holds, and a checkpoint
written at one world size (and mode) reads back at another.

The state dict has the layout of ``torch.distributed.checkpoint.state_dict.get_state_dict`` (torchtitan's):
``{"model": model.state_dict(), "optim": {"state": {fqn: {key: tensor}}, "param_groups": [{..., "params":
[fqn, ...]}]}, "transpiler": {"extra": {...}, "schedule": {...}, "setup": {...}}}``. Under ``zero1``/``zero2`` an
optimizer-state tensor is this rank's flat slice ``[lo, hi)`` of its parameter; it is saved as a
``ShardedTensor`` with the parameter's global shape, whose local shards are that slice cut into row-major boxes
(:func:`flat_boxes`), so DCP can read any layout into any other: written at W=4, read at W=2 or at W=1, and read
into a plain model and optimizer with ``get_state_dict``/``set_state_dict``. Everything else is the same on
every rank and saved once (DCP drops replicated copies). Under ``zero3`` the parameters are this rank's slices
too, and are saved the same way (:func:`model_state`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch._C._distributed_c10d import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from transpiler.errors import CheckpointError

from .sharded_params import held_slice
from .step_state import parameter_names

Box = tuple[list[int], list[int], int]  # offsets, sizes, flat start


@dataclass(frozen=True)
class Ranks:
    """Where a checkpoint's collectives run: this rank, the world size, and the step's group over all ranks
    (whose timeout bounds them; None: no torch.distributed world)."""

    rank: int
    world: int
    group: ProcessGroup | None


def flat_boxes(shape: Iterable[int], lo: int, hi: int) -> list[Box]:
    """The elements ``[lo, hi)`` of a row-major tensor of ``shape``, as boxes (each one a contiguous run of the
    flat tensor): a partial first row, whole rows, a partial last row, recursively. In flat order."""
    shape = list(shape)
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [([lo], [hi - lo], lo)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        return [([first] + [0] * (len(shape) - 1), [last - first + 1, *shape[1:]], lo)]
    if first == last:
        base = first * inner
        return [([first, *o], [1, *s], base + f) for o, s, f in flat_boxes(shape[1:], lo - base, hi - base)]
    cut_lo = lo if lo % inner == 0 else (first + 1) * inner
    cut_hi = hi if hi % inner == 0 else last * inner
    return flat_boxes(shape, lo, cut_lo) + flat_boxes(shape, cut_lo, cut_hi) + flat_boxes(shape, cut_hi, hi)


def sharded(flat: torch.Tensor, shape: torch.Size, lo: int, ranks: Ranks) -> ShardedTensor:
    """A ShardedTensor of global ``shape`` whose local shards are views of ``flat`` (elements ``[lo, lo +
    flat.numel())`` of the whole tensor), so DCP reads into ``flat`` in place. Collective: every rank calls it."""
    where = f"rank:{ranks.rank}/{flat.device}"
    boxes = box_views(flat, shape, lo)
    shards = [Shard(view, ShardMetadata(offsets, list(view.shape), where)) for offsets, view in boxes]
    return init_from_local_shards(shards, *shape, process_group=ranks.group)


def box_views(flat: torch.Tensor, shape: Iterable[int], lo: int) -> list[tuple[list[int], torch.Tensor]]:
    """The boxes (:func:`flat_boxes`) of elements ``[lo, lo + flat.numel())`` of a tensor of ``shape``, each with
    its offsets and the view of ``flat`` that holds it."""
    return [
        (offsets, flat[start - lo : start - lo + math.prod(sizes)].view(sizes))
        for offsets, sizes, start in flat_boxes(shape, lo, lo + flat.numel())
    ]


def model_state(
    model: torch.nn.Module, whole: dict[str, tuple[int, ...]], shards: dict[str, tuple[int, int]], ranks: Ranks
) -> dict[str, Any]:
    """``model.state_dict()``, with each parameter held as its slice (ZeRO-3: ``whole`` gives its shape) as a
    ShardedTensor of the whole shape over the slice (a view of it at one rank), so DCP writes and reads it in
    place at any world size."""
    names = parameter_names(model)
    state: dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = names.get(id(value))
        value = value.detach()
        if name in whole:  # on every rank, even one whose slice is the whole (ShardedTensor is collective)
            shape = torch.Size(whole[name])
            value = sharded(value.reshape(-1), shape, shards[name][0], ranks) if ranks.world > 1 else value.view(shape)
        state[key] = value
    return state


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    shards: dict[str, tuple[int, int]],
    ranks: Ranks,
    whole: dict[str, tuple[int, ...]],
) -> dict[str, Any]:
    """``get_state_dict``'s layout of the optimizer, with this rank's slices as ShardedTensors (``whole``: the
    shapes of parameters held as slices, under ZeRO-3)."""
    state: dict[str, dict[str, Any]] = {}
    for param, entries in optimizer.state.items():
        name = names[id(param)]
        bounds = shards.get(name)
        shape = torch.Size(whole.get(name, param.shape))
        state[name] = {}
        for key, value in entries.items():
            if bounds is not None and torch.is_tensor(value) and value.dim() > 0:
                flat = held_slice(value, shape.numel(), bounds)
                # in the parameter's shape, as eager holds it; sharded on every rank when there are several
                value = sharded(flat, shape, bounds[0], ranks) if ranks.world > 1 else flat.view(shape)
            state[name][key] = value
    return {"state": state, "param_groups": named_param_groups(optimizer, names)}


def named_param_groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def save(state: dict[str, Any], path: str | Path, ranks: Ranks) -> None:
    with _one_process_quietly():
        dcp.save(state, checkpoint_id=str(path), process_group=ranks.group, no_dist=not is_distributed())


def read_setup(path: str | Path, ranks: Ranks) -> dict[str, Any]:
    """The ``transpiler.setup`` entry of a checkpoint (what it was written by), read before anything else."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except (FileNotFoundError, OSError) as exc:
        raise CheckpointError(f"no checkpoint at '{path}': {exc}. Write one with step.save_checkpoint(path).") from exc
    keys = [p[-1] for p in metadata.planner_data.values() if p[:2] == ("transpiler", "setup")]
    if not keys:
        raise CheckpointError(
            f"'{path}' is a torch.distributed.checkpoint folder that step.save_checkpoint() did not write: read it "
            "with torch.distributed.checkpoint.load into your model and optimizer."
        )
    setup: dict[str, Any] = {"transpiler": {"setup": dict.fromkeys(keys)}}
    load(setup, path, ranks)
    return setup["transpiler"]["setup"]


def load_template(
    path: str | Path,
    model_template: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    shards: dict[str, tuple[int, int]] | None,
    ranks: Ranks,
    whole: dict[str, tuple[int, ...]],
) -> tuple[dict[str, Any], dict[tuple[str, str], torch.Tensor]]:
    """What this rank reads from the checkpoint at ``path``: the model's own tensors (``model_template``, read in
    place: :func:`model_state`), and
    optimizer and transpiler state shaped as the checkpoint's metadata says, with this rank's slices where
    ``shards`` says so. Also the flat slice buffers by ``(fqn, key)``, which DCP fills through the shards."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    by_name = {p_name: p for p_name, p in model.named_parameters()}
    template: dict[str, Any] = {"model": model_template, "optim": {"state": {}, "param_groups": None}}
    slices: dict[tuple[str, str], torch.Tensor] = {}
    for flat_key, path_of in metadata.planner_data.items():
        entry = metadata.state_dict_metadata[flat_key]
        if path_of[0] == "optim" and path_of[1] == "state":
            name, key = path_of[2], path_of[3]
            if name not in by_name:
                raise CheckpointError(
                    f"the checkpoint holds optimizer state for '{name}', which this model does not have."
                )
            value: Any = None
            if isinstance(entry, TensorStorageMetadata):
                dtype, size = entry.properties.dtype, tuple(entry.size)
                bounds = shards.get(name) if shards and ranks.world > 1 else None
                shape = torch.Size(whole.get(name, by_name[name].shape))
                if bounds is not None and size == tuple(shape) and len(size) > 0:
                    flat = torch.empty(bounds[1] - bounds[0], dtype=dtype, device=by_name[name].device)
                    slices[(name, key)] = flat
                    value = sharded(flat, shape, bounds[0], ranks)
                else:
                    value = torch.empty(size, dtype=dtype, device=by_name[name].device)
            template["optim"]["state"].setdefault(name, {})[key] = value
        elif path_of[0] == "transpiler":
            put_at(template, path_of, empty_like_entry(entry))
    template["optim"]["param_groups"] = named_param_groups(optimizer, names)
    return template, slices


def load_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], state: dict[str, dict[str, Any]], groups: list[dict]
) -> None:
    """``optimizer.load_state_dict`` from state and param groups keyed by parameter name (``names``: by ``id``)."""
    index = {names[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    optimizer.load_state_dict(
        {
            "state": {index[name]: entries for name, entries in state.items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
        }
    )


def empty_like_entry(entry: Any) -> Any:
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return None  # an object: DCP puts it in


def put_at(tree: dict[str, Any], path: tuple, value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


class SlicePlanner(DefaultLoadPlanner):
    """DCP's load planner without its guess at pre-2.4 checkpoints: it takes a checkpoint key missing from the
    state dict for an old key format, but here it means a rank that owns none of a parameter (no local shard),
    and the old format then misses ``optim.param_groups``."""

    def create_local_plan(self) -> LoadPlan:
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


def load(template: dict[str, Any], path: str | Path, ranks: Ranks, planner: SlicePlanner | None = None) -> None:
    with _one_process_quietly():
        dcp.load(
            template,
            checkpoint_id=str(path),
            planner=planner or SlicePlanner(),
            process_group=ranks.group,
            no_dist=not is_distributed(),
        )


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group exists, even when told ``no_dist``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
