"""A mode's strategy under a torchft quorum (``transpile(fault_tolerance=...)``): what changes in its pipeline.

Four passes change, and one is added. ``scale-loss-grad`` (and DiLoCo's ``diloco-outer-step``) divides by the
step's input ``participants`` instead of the world size: a quorum's size changes from step to step, and the graph
must not be traced again for it. ``broadcast-params`` goes, since torchft makes every group start from the first
one's state (``init_sync``) and heals a late group from a peer. In a group of several ranks each rank takes that
state from the rank of its place in a peer group, which torchft picks per place, so some ranks of a group may heal
at the start and others not: a broadcast inside the group would be run by some of its ranks only. The ranks of
the groups must start alike (a seeded model), as under torchft. ``flatten-update`` and ``reinplace-optimizer`` go,
so that the update writes new tensors (the flat update writes into the parameters' flat storage) and a step that
the quorum does not commit leaves the old ones untouched; the update stays multi-tensor (``foreach-update``).
The data-parallel modes end with ``overlap-quorum``: the commit vote is cast inside the step once its last
collective is waited for, and with ``FaultTolerance(async_quorum=True)`` the step waits at its first collective
across groups for the quorum taken while it ran.

In a replica group of several ranks the data-parallel modes reduce in two levels (HSDP's layout): each bucket
(``allreduce``: each gradient) is all-reduced in the group's own process group, then summed on axis ``across``
with the same bucket of the other groups; ZeRO-1/2/3 reduce-scatter in the group and sum each rank's shard across.
The loss gradient is seeded with 1/ranks × 1/participants. Every rank of every group holds the same weights (and,
but for ZeRO's slices, the same optimizer state), so a rank heals from whichever peer torchft pairs it with.

A replica group of several ranks is one of DiLoCo's replicas (HSDP's layout, ``replica_size`` = the group's size):
its inner steps are data parallel over the group's own process group with ZeRO-1/2 inside (``replica_mode``),
each rank holding its slice of the inner optimizer's state, which it heals from the rank of its place in a peer
group; the syncs average across groups on axis ``across``, which the quorum's process group serves (each rank
with the ranks of its place in the other groups, as torchft pairs them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transpiler.errors import ConfigurationError
from transpiler.graph.pipeline import Pass
from transpiler.graph.rank_layouts import AcrossGroups

from .modes import build_strategy
from .options import make
from .strategy import Strategy

# the modes built under a quorum
QUORUM_MODES = ("allreduce", "fused_allreduce", "zero1", "zero2", "zero3", "diloco", "streaming_diloco")
# reduced in two levels: in the group (reduce-scatter for ZeRO), then each bucket or shard summed across groups;
# the data-parallel ones only for a group of several ranks (one rank reduces across the groups directly)
_TWO_LEVEL = ("zero1", "zero2", "zero3")
_DATA_PARALLEL = ("allreduce", "fused_allreduce")
# options that change what a step is, which the quorum's one-step vote does not cover yet, with why
_NOT_UNDER_QUORUM = {
    "accumulate_steps": (1, "spreads one update over several"),
    "freeze_groups": (0, "spreads one update over several"),
    "fragment_sync_delay": (0, "leaves a fragment's exchange in flight from one step to a later one"),
    "exchange_dtype": ("float32", "sends each group's share of the sum to one rank of a fixed world (all-to-all)"),
}
_DROPPED = frozenset({"broadcast-params", "flatten-update", "reinplace-optimizer"})


def quorum_strategy(mode: str, options: dict[str, Any], group_size: int, overlap: bool = True) -> Strategy:
    """The strategy of ``mode`` for one replica group of ``group_size`` ranks under a torchft quorum; an error for
    a mode, option or group size that is not built for it, saying what is. The data-parallel modes vote where the
    step can no longer fail (``overlap-quorum``), and with ``overlap`` wait there for a quorum taken while the
    step runs."""
    if mode not in QUORUM_MODES:
        raise ConfigurationError(
            f"fault_tolerance is built for modes {', '.join(QUORUM_MODES)}; mode '{mode}' is not yet. Use one "
            "of those, or drop fault_tolerance (torchrun's elastic restarts still recover every mode)."
        )
    for name, (off, why) in _NOT_UNDER_QUORUM.items():
        if options.get(name, off) != off:
            raise ConfigurationError(
                f"option {name} does not run under fault_tolerance yet: a quorum votes on each step, and {name} "
                f"{why}. Drop it, or drop fault_tolerance."
            )
    if mode in _TWO_LEVEL or (mode in _DATA_PARALLEL and group_size > 1):
        strategy = build_strategy(mode, options)
        variants = {
            variant: [_across(p) for p in _rewritten(passes, overlap)] for variant, passes in strategy.variants.items()
        }
        return dataclasses.replace(strategy, variants=variants, layout=AcrossGroups(strategy.layout))
    replica_size = options.get("replica_size", group_size)
    if replica_size != group_size:
        raise ConfigurationError(
            f"under fault_tolerance a replica is one replica group, of {group_size} rank(s) here; replica_size="
            f"{replica_size} disagrees. Leave replica_size out."
        )
    if group_size > 1 and options.get("replica_mode", "fused_allreduce") == "fused_allreduce":
        raise ConfigurationError(
            f"under fault_tolerance a replica group of several ranks ({group_size} here) shards its inner optimizer "
            "state: give replica_mode='zero1' or 'zero2'. A returning group's ranks heal from the peers torchft "
            "picks for each, which are mid-round with optimizer states of their own; a whole copy per rank would "
            "leave the group's ranks with different states, a slice per rank does not."
        )
    if group_size > 1:
        options = {**options, "replica_size": group_size}
    strategy = build_strategy(mode, options)
    every_step = strategy.outer is None  # DiLoCo's syncs take theirs before the step and vote after it
    overlap_in = overlap if every_step else None
    variants = {variant: _rewritten(passes, overlap_in) for variant, passes in strategy.variants.items()}
    return dataclasses.replace(strategy, variants=variants)


def _rewritten(passes: list[Pass], overlap: bool | None) -> list[Pass]:
    """The passes under a quorum; ``overlap`` None: no vote inside the step (DiLoCo), else the vote, and with
    True the wait for a quorum taken beside the step."""
    kept = [_counting(p) for p in passes if p.name not in _DROPPED]
    return kept if overlap is None else [*kept, make("overlap-quorum", wait=overlap)]


def _across(p: Pass) -> Pass:
    """The gradients' reduction in the group, with each reduced bucket or shard then summed across the groups."""
    return dataclasses.replace(p, across=True) if p.reduces_gradients and hasattr(p, "across") else p


def _counting(p: Pass) -> Pass:
    """A pass that divides by the world size, dividing by the step's participant count instead."""
    if p.name == "scale-loss-grad" and p.axis == "world":  # a group's own mean (axis replica) keeps its 1/size
        return make("scale-loss-grad", participants=True)
    if p.name == "diloco-outer-step":
        return dataclasses.replace(p, participants=True)
    return p
