"""ZeRO-3's parameters between steps: each one held as this rank's 1-D slice, gathered whole on request.

``shard-params`` makes a program read every parameter of ``program.param_buckets`` as the slice
``p.view(-1)[lo:hi]`` (``program.shards``) and write it back updated. Before the first such step
:func:`hold_slices` cuts the model's parameters to those slices (``p.data``; the parameter objects stay, so
optimizers, hooks and the step's cache keys keep working), and :func:`gather_whole` /
:func:`hold_slices` swap them whole and back for ``step.gathered()`` (:class:`LentParameters`, which lends them
to the block). Where ``flatten-update`` laid a bucket out flat, the slices are then bound to views of this
rank's flat shard (``flat_storage.py``), which ``step.gathered()`` writes back into. A forward pre-hook
(:class:`SlicedForwardGuard`) turns a forward run on the slices into a clear error. :func:`held_slice` is the
one place a whole tensor is cut to this rank's slice (state, parameters, checkpoints).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.program import ParamBucket, StepProgram

from .process_group import Placement

Shards = dict[str, tuple[int, int]]


def held_slice(value: torch.Tensor, numel: int, bounds: tuple[int, int]) -> torch.Tensor:
    """A tensor of a sharded parameter (its state, or itself) as this rank's flat slice ``bounds`` of the
    parameter's ``numel`` elements: a view, cut here when the tensor is still whole."""
    lo, hi = bounds
    flat = value.reshape(-1)
    return flat[lo:hi] if flat.numel() == numel and hi - lo < numel else flat


def hold_slices(
    params: dict[str, torch.nn.Parameter],
    buckets: list[ParamBucket],
    shards: Shards,
    keep: dict[str, torch.Tensor] | None = None,
) -> None:
    """Cut every whole parameter of ``buckets`` to this rank's slice (a copy, so the whole tensor, or the bucket
    buffer :func:`gather_whole` made it a view of, is freed); a parameter already held as its slice stays.
    With ``keep`` (the slices held before ``step.gathered()``), a slice is copied back into the tensor it was
    before, so a captured program, which reads its inputs where they were captured, need not capture again."""
    keep = keep or {}
    for bucket in buckets:
        for name, shape in zip(bucket.names, bucket.shapes):
            param, (lo, hi) = params[name], shards[name]
            whole = math.prod(shape)
            old = keep.get(name)
            if old is not None and (old.shape, old.dtype, old.device) == ((hi - lo,), param.dtype, param.device):
                if param.data_ptr() != old.data_ptr():  # whole (gathered, or replaced inside the block)
                    with torch.no_grad():
                        old.copy_(held_slice(param.detach(), whole, (lo, hi)))
                param.data = old
                continue
            own = param.untyped_storage().nbytes() == (hi - lo) * param.element_size()
            if tuple(param.shape) == (hi - lo,) and own:  # not a view of a gathered bucket
                continue
            param.data = held_slice(param.detach(), whole, (lo, hi)).clone()  # a view would hold a gathered bucket


def gather_whole(
    params: dict[str, torch.nn.Parameter],
    buckets: list[ParamBucket],
    shards: Shards,
    rank: int,
    world: int,
    group: str,
) -> None:
    """Make every parameter of ``buckets`` whole again (``p.data``, a view of its bucket's gathered buffer):
    one all-gather per bucket of the ranks' slices, laid out as the program lays them out. Every rank calls it."""
    with torch.no_grad():
        for bucket in buckets:
            first = params[bucket.names[0]]
            shard = bucket.length // world
            mine = torch.zeros(shard, dtype=first.dtype, device=first.device)
            for name, start in zip(bucket.names, bucket.starts):
                lo, hi = shards[name]
                if hi > lo:
                    mine[start + lo - rank * shard : start + hi - rank * shard] = params[name].detach().reshape(-1)
            full = WAIT(C10D.all_gather_into_tensor.default(mine, world, group))
            for name, start, shape in zip(bucket.names, bucket.starts, bucket.shapes):
                params[name].data = full[start : start + math.prod(shape)].view(shape)


class SlicedForwardGuard:
    """A forward pre-hook: running the model while its parameters are slices fails with what to do instead.

    It looks at one parameter whose slice differs in shape from the whole (under tracing the module holds
    whole stand-ins, so the hook stays silent). Beside a tensor-parallel plan the whole is this rank's shard, and
    the plan's root pre-hook (which runs first) has wrapped it in a DTensor: the guard looks at the local shard."""

    def __init__(self, model: torch.nn.Module, buckets: list[ParamBucket], shards: Shards):
        self.where: tuple[torch.nn.Module, str, tuple[int, ...]] | None = None
        for bucket in buckets:
            for name, shape in zip(bucket.names, bucket.shapes):
                lo, hi = shards[name]
                if self.where is None and (hi - lo,) != tuple(shape):
                    owner, _, leaf = name.rpartition(".")
                    self.where = (model.get_submodule(owner), leaf, tuple(shape))
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if self.where is None:
            return
        owner, leaf, shape = self.where
        held = getattr(owner, leaf)
        if tuple((held.to_local() if isinstance(held, DTensor) else held).shape) != shape:
            raise ConfigurationError(
                "under zero3 the model's parameters hold this rank's slices between steps, so the model cannot run "
                "on its own. Evaluate or save it inside `with step.gathered(): ...` (every rank enters it: it "
                "all-gathers the parameters), or save with step.save_checkpoint()."
            )


class LentParameters:
    """ZeRO-3's parameters as a step holds them: this rank's slices between steps (cut once, and again after
    :meth:`gathered`, the only place they are whole), lent whole to a ``with step.gathered():`` block."""

    def __init__(self, model: torch.nn.Module, placement: Placement) -> None:
        self.model = model
        self.placement = placement
        self.sliced = False  # the model's parameters are this rank's slices
        self.guard: SlicedForwardGuard | None = None  # a forward on the slices fails clearly

    def hold(
        self, program: StepProgram, params: dict[str, torch.nn.Parameter], keep: dict[str, torch.Tensor] | None = None
    ) -> None:
        """The model holds this rank's slice of each sharded parameter (into the ``keep`` tensors where given; a
        no-op while it does), and a forward on the slices fails clearly."""
        if self.sliced:
            return
        hold_slices(params, program.param_buckets, program.shards, keep)
        self.sliced = True
        if self.guard is None:
            self.guard = SlicedForwardGuard(self.model, program.param_buckets, program.shards)

    @contextlib.contextmanager
    def gathered(
        self, program: StepProgram, params: dict[str, torch.nn.Parameter], writeback: bool
    ) -> Iterator[torch.nn.Module]:
        """The model with whole parameters inside the block (each rank's slices all-gathered, one bucket at a time);
        on leaving, every rank keeps its slice of what they then hold (``writeback=False``: of what they held
        before), in the same slice tensors, so a captured program need not capture again."""
        self.hold(program, params)
        before = {name: params[name].data for bucket in program.param_buckets for name in bucket.names}
        placement = self.placement
        gather_whole(
            params, program.param_buckets, program.shards, placement.rank, placement.world_size, program.group_name
        )
        self.sliced = False
        try:
            yield self.model
        finally:
            if not writeback:
                for name, data in before.items():
                    params[name].data = data
            self.hold(program, params, keep=before)
