"""What a mode builds, as data: the passes of each program variant, the schedule that picks one each step, the
layout of the ranks, the checks its optimizers must pass, and whether it keeps the ranks in step; and what one
rank needs of it, computed once (:meth:`Strategy.for_rank`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

import passes
from transpiler.graph.pipeline import Pass, check_order
from transpiler.graph.rank_layouts import AcrossGroups, Layout, OneDimension

from .checks import WholeTensorRefused
from .schedules import EveryStep, Schedule


class OptimizerCheck(Protocol):
    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise a ConfigurationError saying why ``optimizer`` does not fit the mode, and what to use instead."""


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer a mode with an outer step builds when the user gives none: ``torch.optim.SGD`` with
    these settings (DiLoCo's default is the paper's Nesterov SGD). ``fixed``: the outer step is the mode's own
    formula (SparseLoCo's ``θ − α·mean``), so a given outer optimizer is refused."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    fixed: bool = False

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)


@dataclass(frozen=True)
class Recipe:
    """A mode's pipeline in parts, so wrapping strategies can be woven in (``composition.py``)."""

    body: dict[str, list[Pass]]  # per variant: the mode's own passes (reduction, averaging)
    prefix: list[Pass] = field(default_factory=list)  # startup (broadcast-params)
    seed: list[Pass] = field(default_factory=list)  # passes that only scale the loss gradient
    tail: list[Pass] = field(default_factory=list)  # after everything (reinplace-optimizer)
    schedule: Schedule = field(default_factory=EveryStep)  # a prototype: each step runs a fresh copy
    layout: Layout = OneDimension()
    checks: tuple[OptimizerCheck, ...] = ()  # of the optimizer, at transpile()
    replicated: bool = False  # see Strategy; what a resharding checkpoint (save_checkpoint) needs
    # set: an accumulation micro-step runs the body too and accumulates its reduced gradients (this rank's
    # slices, ZeRO-2/3), then these passes in place of the tail; unset: micro-steps accumulate raw gradients
    micro_tail: list[Pass] | None = None
    micro_body: list[Pass] | None = None  # what a sharded recipe's micro-step runs, when not ``body["step"]``
    gradient_axis: str = "world"  # the ranks that share a gradient: loss scaling and clipping work across them
    outer: tuple[OptimizerCheck, ...] | None = None  # see Strategy
    outer_sgd: OuterSGD = OuterSGD()  # see Strategy


@dataclass(frozen=True)
class Strategy:
    """A pass list per program variant, and the schedule choosing between them; every pipeline's order is
    checked when the strategy is made (``check_order``), before anything is traced."""

    variants: dict[str, list[Pass]]
    schedule: Schedule = field(default_factory=EveryStep)  # a prototype, never stepped: see fresh_schedule()
    layout: Layout = OneDimension()
    checks: tuple[OptimizerCheck, ...] = ()
    replicated: bool = False  # after every update all ranks hold the same model and optimizer (or its slices)
    # not None: the mode applies an outer optimizer (DiLoCo), which transpile() traces beside the step, and these
    # are its checks
    outer: tuple[OptimizerCheck, ...] | None = None
    outer_sgd: OuterSGD = OuterSGD()  # the outer optimizer when none is given

    def __post_init__(self) -> None:
        for pipeline in self.variants.values():
            check_order(pipeline)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        for check in self.checks:
            check(optimizer)

    def check_outer(self, optimizer: torch.optim.Optimizer) -> None:
        for check in self.outer or ():
            check(optimizer)

    def fresh_schedule(self) -> Schedule:
        """A schedule at step 0."""
        return copy.deepcopy(self.schedule)

    def specs(self) -> dict[str, str]:
        """Each variant's pipeline spec."""
        return {variant: ",".join(p.spec() for p in passes) for variant, passes in self.variants.items()}

    def passes(self) -> Iterator[Pass]:
        for pipeline in self.variants.values():
            yield from pipeline

    def beside_tensor_parallel(self) -> Strategy:
        """This strategy beside torch's tensor-parallel plan: the programs are the same (the trace holds each rank's
        shards), and an optimizer that needs whole tensors is refused (``WholeTensorRefused``)."""
        return dataclasses.replace(self, checks=(*self.checks, WholeTensorRefused()))

    def compiled(self) -> Strategy:
        """This strategy for programs Inductor compiles, each pass as :meth:`Pass.for_inductor` gives it:
        ``reinplace-optimizer`` leaves Adam's step size multiplied in (Inductor fuses that product into the update,
        and has no lowering for the op the fold makes); the sparse exchanges (SparseLoCo's, DeMo's) call their
        selection and decoding inline, for Inductor to compile with the rest rather than run as opaque ops."""
        variants = {variant: [p.for_inductor() for p in pipeline] for variant, pipeline in self.variants.items()}
        return dataclasses.replace(self, variants=variants)

    def under_quorum(self, *, vote: bool, wait: bool, two_level: bool, in_place: bool = False) -> Strategy:
        """This strategy for one replica group under a torchft quorum (``transpile(fault_tolerance=...)``).

        ``scale-loss-grad`` (and DiLoCo's ``diloco-outer-step``) divide by the step's input ``participants``, not
        the world size: a quorum's size changes from step to step, and the graph must not be traced again for it.
        ``broadcast-params`` goes: torchft makes every group start from the first one's state (``init_sync``) and
        heals a late group from a peer, each rank from the rank of its place in a peer group, so some ranks of a
        group may heal and others not, and a broadcast inside the group would be run by some of its ranks only (the
        ranks must start alike: a seeded model, as under torchft). A step the quorum does not commit must leave every
        input untouched: with ``in_place`` (an update that writes nothing before its last collective, run uncompiled)
        ``flatten-update`` and ``reinplace-optimizer`` stay and ``overlap-quorum`` holds the first write until the vote
        is counted; else they go, and the update writes new tensors (multi-tensor still, ``foreach-update``). Without
        ``vote`` (DiLoCo's syncs, voted on after the step) ``gather-params`` makes the gathered values the step's
        outputs instead of copying them into the parameters mid-step. With ``vote`` the step ends with
        ``overlap-quorum``, the commit vote cast once its last collective is waited for (``wait``: and the wait at its
        first collective across groups for a quorum taken while it ran); DiLoCo's syncs take their quorum before the
        step and vote after it. With ``two_level`` (HSDP's layout: a group of several ranks) each reducing pass
        reduces in the group, then sums each bucket or shard across the groups (axis ``across``)."""

        def rewritten(pipeline: list[Pass]) -> list[Pass]:
            dropped = DROPPED_UNDER_QUORUM - (IN_PLACE if in_place and vote else frozenset())
            kept = [_counting(p) for p in pipeline if p.name not in dropped]
            kept = kept if vote else [_unwritten(p) for p in kept]
            kept = [_across(p) for p in kept] if two_level else kept
            return [*kept, passes.OverlapQuorum(wait=wait)] if vote else kept

        variants = {variant: rewritten(pipeline) for variant, pipeline in self.variants.items()}
        layout = AcrossGroups(self.layout) if two_level else self.layout
        return dataclasses.replace(self, variants=variants, layout=layout)

    def for_rank(self, world: int, rank: int) -> RankPlan:
        """What ``rank`` of a world of ``world`` needs: its variants, every process group in creation order, every
        rank's axes (without a live world the static check builds every rank's program), and a fresh schedule."""
        return RankPlan(
            world_size=world,
            rank=rank,
            variants=self.variants,
            groups=tuple(self.layout.groups(world)),
            axes=tuple(self.layout.axes(world, r) for r in range(world)),
            schedule=self.fresh_schedule(),
        )


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a strategy."""

    world_size: int
    rank: int
    variants: dict[str, list[Pass]]
    groups: tuple[tuple[int, ...], ...]  # every rank subset to create as a process group, in one order
    axes: tuple[dict[str, tuple[int, ...]], ...]  # per rank of the world: each axis's ranks
    schedule: Schedule

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """The ranks of this rank's replica (DiLoCo's 2-D layout), or this rank alone."""
        return self.axes[self.rank].get("replica", (self.rank,))


# the passes a step under a quorum leaves out: a broadcast that not every rank of a group would run, and the
# in-place update (IN_PLACE), so that an uncommitted step leaves the old values untouched, unless the vote holds
# the update's writes back (Strategy.under_quorum)
IN_PLACE = frozenset({"flatten-update", "reinplace-optimizer"})
DROPPED_UNDER_QUORUM = frozenset({"broadcast-params"}) | IN_PLACE


def _across(p: Pass) -> Pass:
    """The gradients' reduction in the group, with each reduced bucket or shard then summed across the groups."""
    return dataclasses.replace(p, across=True) if p.reduces_gradients and hasattr(p, "across") else p


def _unwritten(p: Pass) -> Pass:
    """Under a quorum voted on after the step (DiLoCo's syncs): the parameters' gathered values as outputs, not
    copied into them mid-step, so that a sync that does not commit leaves them as they were."""
    return dataclasses.replace(p, in_place=False) if p.name == "gather-params" else p


def _counting(p: Pass) -> Pass:
    """A pass that divides by the world size, dividing by the step's participant count instead."""
    if p.name == "scale-loss-grad" and p.axis == "world":  # a group's own mean (axis replica) keeps its 1/size
        return passes.ScaleLossGrad(participants=True)
    if p.name == "diloco-outer-step":
        return dataclasses.replace(p, participants=True)
    return p
