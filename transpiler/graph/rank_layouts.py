"""How a strategy lays out the ranks: the process groups it needs, and each rank's axes.

A layout answers two questions for a world size: which rank subsets become process groups (all of them, in one
order, since every rank must create every group alike), and for a rank, the ranks it shares each axis with
(``program.axes``: a pass with ``axis=replica`` works across that axis's ranks). A one-dimensional layout has no
groups and no axes. DiLoCo's replicas (:class:`ReplicaLayout`) and AdaSum's recursive halving
(:class:`AdaSumGeometry`, which its pass also reads to pair ranks) are the two others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from transpiler.errors import ConfigurationError


class Layout(Protocol):
    def groups(self, world: int) -> list[tuple[int, ...]]:
        """Every rank subset the strategy needs as a process group, in one order for every rank."""

    def axes(self, world: int, rank: int) -> dict[str, tuple[int, ...]]:
        """Each axis of ``rank``: the ranks that share it (no axes: one dimension)."""


@dataclass(frozen=True)
class OneDimension:
    """Every rank alike: no subgroups, no axes."""

    def groups(self, world: int) -> list[tuple[int, ...]]:
        return []

    def axes(self, world: int, rank: int) -> dict[str, tuple[int, ...]]:
        return {}


@dataclass(frozen=True)
class ReplicaLayout:
    """Replicas of ``size`` consecutive ranks (a host, say): axis ``replica`` is a rank's replica, axis ``across``
    the ranks that hold the same place in every replica. Size 1: no axes."""

    size: int

    def _check(self, world: int) -> None:
        if world % self.size:
            raise ConfigurationError(
                f"replica_size={self.size} does not divide the world size {world}: every replica needs "
                "the same number of ranks."
            )

    def axes(self, world: int, rank: int) -> dict[str, tuple[int, ...]]:
        self._check(world)
        if self.size == 1:
            return {}
        start, place = rank - rank % self.size, rank % self.size
        return {
            "replica": tuple(range(start, start + self.size)),
            "across": tuple(range(place, world, self.size)),
        }

    def groups(self, world: int) -> list[tuple[int, ...]]:
        """Every replica's group, then every ``across`` group, in one order for every rank."""
        self._check(world)
        if self.size == 1:
            return []
        replicas = [tuple(range(s, s + self.size)) for s in range(0, world, self.size)]
        return replicas + [tuple(range(place, world, self.size)) for place in range(self.size)]


@dataclass(frozen=True)
class AcrossGroups:
    """``inner``'s layout, with axis ``across`` for every rank (itself alone, as the world sees it): the ranks of
    its place in the other replica groups of a torchft quorum, which the quorum's process group joins. It adds no
    group to create in the world."""

    inner: Layout

    def groups(self, world: int) -> list[tuple[int, ...]]:
        return self.inner.groups(world)

    def axes(self, world: int, rank: int) -> dict[str, tuple[int, ...]]:
        return {"across": (rank,), **self.inner.axes(world, rank)}


@dataclass(frozen=True)
class AdaSumLayout:
    """AdaSum's groups (:class:`AdaSumGeometry`) with ``local_size`` ranks averaged first."""

    local_size: int

    def groups(self, world: int) -> list[tuple[int, ...]]:
        return AdaSumGeometry(world, self.local_size).groups()

    def axes(self, world: int, rank: int) -> dict[str, tuple[int, ...]]:
        return {}


@dataclass(frozen=True)
class AdaSumGeometry:
    """Who pairs with whom, and which ranks each level's statistics span."""

    world: int
    local_size: int = 1

    def __post_init__(self) -> None:
        if self.local_size < 1 or self.world % self.local_size:
            raise ConfigurationError(
                f"local_size={self.local_size} must divide the world size {self.world} (groups of consecutive ranks)."
            )
        p = self.participants
        if p & (p - 1):
            raise ConfigurationError(
                f"AdaSum needs a power-of-two number of participants; world size {self.world} with "
                f"local_size={self.local_size} gives {p}. Use 1, 2, 4, 8... ranks (or groups)."
            )

    @property
    def participants(self) -> int:
        return self.world // self.local_size

    @property
    def levels(self) -> list[int]:
        return [1 << i for i in range(self.participants.bit_length() - 1)]

    def local_group(self, rank: int) -> tuple[int, ...]:
        start = rank - rank % self.local_size
        return tuple(range(start, start + self.local_size))

    def level_group(self, level: int, rank: int) -> tuple[int, ...]:
        q, li = divmod(rank, self.local_size)
        block = q // (2 * level) * 2 * level
        return tuple(j * self.local_size + li for j in range(block, block + 2 * level))

    def partner(self, level: int, rank: int) -> int:
        q, li = divmod(rank, self.local_size)
        return (q ^ level) * self.local_size + li

    def groups(self) -> list[tuple[int, ...]]:
        """Every subgroup any rank needs, in one order, so all ranks can create them alike."""
        out = [self.local_group(r) for r in range(0, self.world, self.local_size)] if self.local_size > 1 else []
        for level in self.levels:
            out += sorted({self.level_group(level, r) for r in range(self.world)})
        return out
