"""The startup handshake: before a program first runs, the ranks compare what they are about to run.

In a live world this is the cross-rank check: each rank builds only its own programs (``transpile()`` without a
world builds and checks every rank's in one process instead), and the handshake also sees ranks that were started
with other settings or another model. Each rank publishes a :class:`Setup` (mode and options per program variant,
schedule settings, parameters, buffers, module modes, optimizer, batch structure, its communication plan, the
slices a sharded optimizer gave it, and the digests of data files baked into the programs) through
torch.distributed's store, reads every other rank's, and compares them: the settings value by value, the
communication plans by simulating them against each other, the slices by checking that they tile every
parameter. All ranks read the same data, so on a difference every rank raises the same
:class:`RankMismatchError`, naming what differs and on which ranks, before any collective could hang or abort on
mismatched sizes. The store is used rather than a collective so that a rank that changed its setup alone (froze a
layer, switched to ``eval()``) cannot be caught up in another rank's all-reduce: it waits for the others in the
store, and fails within the timeout if they never come.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from transpiler.errors import CommunicationError, RankMismatchError, VerificationError
from transpiler.graph.collectives import CommOp
from transpiler.graph.verify import Held, check_tiling, simulate_communication


@dataclass(frozen=True)
class Setup:
    """What one rank is about to run; every field must agree across ranks."""

    world_size: int
    mode: dict[str, str]  # variant -> pass spec with options
    schedule: dict[str, Any]  # settings (not counters)
    timeout_s: float
    parameters: tuple[tuple[str, tuple[int, ...], str, bool], ...]  # name, shape, dtype, requires_grad
    buffers: tuple[tuple[str, tuple[int, ...], str], ...]
    training: tuple[tuple[str, bool], ...]  # module name, training flag
    optimizer: dict[str, str]  # class name and per-group hyper-parameters other than lr
    batch: tuple[str, ...]  # dtypes of the batch's tensors (shapes may differ: an uneven last batch)
    communication: dict[str, list[CommOp]]  # per variant; compared by simulating the plans against each other
    groups: dict[str, tuple[int, ...]]  # process-group name -> ranks
    sources: dict[str, str] = field(default_factory=dict)  # data files the programs embed -> SHA-256 (a PCA basis)
    compiled: bool = False  # compile=True: compiled programs round differently from uncompiled ones
    # under a sharded optimizer: the slices this rank updates, and its shard group and place in it
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    shard_place: tuple[str, int] = ("world", 0)

    def comparable(self) -> dict[str, Any]:
        """The fields compared value by value (all but what differs by rank: plans, groups, slices)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PER_RANK}


PER_RANK = ("communication", "groups", "shards", "shard_place")  # compared by simulation or tiling, not equality


def describe_model(model: torch.nn.Module, whole: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, tuple]:
    """Parameters (by their ``whole`` shape where a rank holds a slice, as under ZeRO-3), buffers and module
    modes, as the Setup records them."""
    whole = whole or {}
    return {
        "parameters": tuple(
            (n, whole.get(n, tuple(p.shape)), str(p.dtype).removeprefix("torch."), p.requires_grad)
            for n, p in model.named_parameters()
        ),
        "buffers": tuple((n, tuple(b.shape), str(b.dtype).removeprefix("torch.")) for n, b in model.named_buffers()),
        "training": tuple((n or "<root>", m.training) for n, m in model.named_modules()),
    }


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """The optimizer's class and each param group's size and hyper-parameters (lr may follow a scheduler)."""
    out = {"class": type(optimizer).__qualname__}
    for i, g in enumerate(optimizer.param_groups):
        hyper = ", ".join(f"{k}={v!r}" for k, v in sorted(g.items()) if k not in ("params", "lr", "initial_lr"))
        out[f"group {i}"] = f"{len(g['params'])} tensors; {hyper}"
    return out


def differences(setups: dict[int, Setup]) -> list[str]:
    """Human-readable differences between the ranks' setups (empty when they agree)."""
    lines = []
    views = {rank: s.comparable() for rank, s in setups.items()}
    for key in next(iter(views.values())):
        by_value: dict[str, list[int]] = {}
        for rank, view in views.items():
            by_value.setdefault(repr(view[key]), []).append(rank)
        if len(by_value) > 1:
            lines.append(_describe_field(key, {tuple(r): views[r[0]][key] for r in by_value.values()}))
    if not lines:  # same setup should mean the same communication; check the plans themselves too
        members = {name: ranks for s in setups.values() for name, ranks in s.groups.items()}
        for variant in next(iter(setups.values())).communication:
            plans = {rank: s.communication.get(variant, []) for rank, s in setups.items()}
            try:
                simulate_communication(plans, members)
            except VerificationError as exc:
                lines.append(f"communication of program '{variant}': {exc}")
    if not lines:
        sizes = {name: math.prod(shape) for name, shape, *_ in next(iter(setups.values())).parameters}
        try:
            check_tiling([Held(rank, *s.shard_place, s.shards) for rank, s in setups.items()], sizes)
        except VerificationError as exc:
            lines.append(f"the ranks' slices of the parameters: {exc}")
    return lines


def _describe_field(key: str, values: dict[tuple[int, ...], Any]) -> str:
    label = key.replace("_", " ")
    (ranks_a, a), (ranks_b, b) = list(values.items())[:2]
    who_a, who_b = _ranks(ranks_a), _ranks(ranks_b)
    if isinstance(a, tuple) and isinstance(b, tuple) and key in ("parameters", "buffers", "training"):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"{label} differ at entry {i}: {who_a} {_entry(x)}, {who_b} {_entry(y)}"
        longer, who = (a, who_a) if len(a) > len(b) else (b, who_b)
        return (
            f"{label}: {who_a} {len(a)} entries, {who_b} {len(b)}; {who} also has {_entry(longer[min(len(a), len(b))])}"
        )
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        return f"{label}: " + "; ".join(f"{k}: {who_a} {a.get(k)!r}, {who_b} {b.get(k)!r}" for k in keys)
    return f"{label}: {who_a} {a!r}, {who_b} {b!r}"


def _entry(entry: tuple) -> str:
    if len(entry) == 2 and isinstance(entry[1], bool):  # a module's mode
        return f"module '{entry[0]}' in {'train' if entry[1] else 'eval'} mode"
    name, shape, dtype, *rest = entry
    frozen = " (frozen)" if rest and not rest[0] else ""
    return f"'{name}' {dtype}{list(shape)}{frozen}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


_instances = 0


def next_instance() -> int:
    """A number for each live step in this process; ranks create their steps in the same order."""
    global _instances
    _instances += 1
    return _instances


@dataclass
class Handshake:
    """Publishes this rank's Setup under a fresh key each round and compares all ranks'."""

    rank: int
    world_size: int
    timeout: timedelta
    group: str = ""  # the step's group: the steps of several data-parallel groups (beside TP) share the store
    instance: int = field(default_factory=next_instance)
    rounds: int = 0

    def agree(self, setup: Setup) -> None:
        """Return when every rank runs the same setup; otherwise raise on every rank."""
        self.rounds += 1
        store = dist.distributed_c10d._get_default_store()
        prefix = f"transpiler/handshake/{self.group}/{self.instance}/{self.rounds}/"
        store.set(prefix + str(self.rank), pickle.dumps(setup))
        keys = [prefix + str(r) for r in range(self.world_size)]
        try:
            store.wait(keys, self.timeout)
        except Exception as exc:  # DistStoreError on timeout, DistNetworkError when the store's host is gone
            try:
                who = f"ranks {[r for r in range(self.world_size) if not store.check([keys[r]])]}"
            except Exception:
                who = "the other ranks (the store is gone: rank 0, which hosts it, has exited)"
            raise CommunicationError(
                f"rank {self.rank}: {who} did not reach the startup handshake (round {self.rounds}) "
                f"within the timeout of {self.timeout.total_seconds():g} s. They stalled, died, or are running "
                "another configuration: a rank that changed its model modes, frozen parameters or param groups "
                "alone checks in here while the others run the old program. Make the same change on every rank."
            ) from exc
        setups = {r: pickle.loads(store.get(keys[r])) for r in range(self.world_size)}
        found = differences(setups)
        if found:
            raise RankMismatchError(
                f"rank {self.rank}: the ranks are set up differently, so they would reduce mismatched data, "
                "abort or hang. Start every rank with the same model, optimizer, mode and options.\n  - "
                + "\n  - ".join(found)
            )
