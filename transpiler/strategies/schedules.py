"""Which program variant runs at each step.

Most modes have one variant, ``"step"``. LocalSGD has two, ``"local"`` and
``"sync"``, and a schedule that picks one per step from a step counter that is
the same on every rank, so all ranks run the same graph without retracing.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Protocol

from transpiler.errors import CheckpointError, ConfigurationError


class Schedule(Protocol):
    """Which variant each step runs. Every rank advances it the same way (from counters and from metrics that are
    the same on every rank), so all ranks run the same program without a collective to agree on it."""

    @property
    def variants(self) -> tuple[str, ...]:
        """Every variant it may choose."""

    def variant(self) -> str:
        """The variant of the next step."""

    def observe(self, variant: str, metrics: dict[str, float], lr: float) -> None:
        """After a step of ``variant``: advance, reading the step's metrics and the learning rate."""

    def settings(self) -> dict:
        """What shapes it: every rank, and a checkpoint loaded into it, must agree on these."""

    def state_dict(self) -> dict:
        """Its counters, which change every step."""

    def load_state_dict(self, state: dict) -> None:
        """Set its counters from :meth:`state_dict`; an unknown counter is an error."""

    def in_flight(self) -> bool:
        """Whether an exchange started by one step waits for a later step to apply it (Streaming DiLoCo)."""


@dataclass
class EveryStep:
    """One variant, every step."""

    variants = ("step",)

    def variant(self) -> str:
        return "step"

    def observe(self, variant: str, metrics: dict[str, float], lr: float) -> None:
        return None

    def settings(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        load_counters(self, state, ())

    def in_flight(self) -> bool:
        return False


@dataclass
class LocalSGDSchedule:
    """Paddle's LocalSGD schedule, and its adaptive variant.

    Steps count from 1. Step ``t`` syncs when ``t <= begin_step`` (warm-up:
    every step) or when ``t - last_sync == k``; ``last_sync`` starts at 0.
    With ``adaptive``, after every sync
    ``k = clip(ceil(sqrt(lr_0 * avg_loss / (lr_t * loss_0) * init_k_steps)), 1, max_k)``,
    where ``loss_0`` and ``lr_0`` are the rank-averaged loss and the learning
    rate at the first sync, and ``avg_loss`` the rank-averaged loss now.
    """

    k_steps: int = 1
    begin_step: int = 1
    adaptive: bool = False
    max_k: int = 16
    step: int = 0
    last_sync: int = 0
    k: int = 0
    lr_0: float | None = None
    loss_0: float | None = None

    variants = ("local", "sync")
    COUNTERS = ("step", "last_sync", "k", "lr_0", "loss_0")

    def __post_init__(self) -> None:
        self.k = self.k or self.k_steps

    def variant(self) -> str:
        t = self.step + 1
        return "sync" if t <= self.begin_step or t - self.last_sync == self.k else "local"

    def observe(self, variant: str, metrics: dict[str, float], lr: float) -> None:
        self.step += 1
        if variant != "sync":
            return
        self.last_sync = self.step
        if self.adaptive:
            self.k = self.next_k(metrics["avg_loss"], lr)

    def next_k(self, avg_loss: float, lr: float) -> int:
        if self.loss_0 is None:
            self.loss_0, self.lr_0 = avg_loss, lr
        if self.loss_0 == 0 or lr == 0:
            return self.max_k
        ratio = self.lr_0 * avg_loss / (lr * self.loss_0) * self.k_steps
        return int(min(max(math.ceil(math.sqrt(max(ratio, 0.0))), 1), self.max_k))

    def settings(self) -> dict:
        """What shapes the schedule: every rank, and a checkpoint loaded into it, must agree on these."""
        return {k: getattr(self, k) for k in ("k_steps", "begin_step", "adaptive", "max_k")}

    def state_dict(self) -> dict:
        """The counters, which change every step (settings travel in the checkpoint's setup)."""
        return {k: v for k, v in asdict(self).items() if k in self.COUNTERS}

    def load_state_dict(self, state: dict) -> None:
        load_counters(self, state, self.COUNTERS)

    def in_flight(self) -> bool:
        return False


def load_counters(schedule: object, state: dict, counters: tuple[str, ...]) -> None:
    """Set only the counters a schedule declares; anything else in a checkpoint is an error."""
    unknown = sorted(set(state) - set(counters))
    if unknown:
        raise CheckpointError(
            f"the checkpoint's schedule state has {unknown}, which {type(schedule).__name__} does not declare "
            f"(it keeps {list(counters) or 'nothing'}): the checkpoint comes from another mode."
        )
    for key in counters:
        if key in state:
            setattr(schedule, key, state[key])


ACCUMULATE = "accumulate"  # the variant of an accumulation micro-step that does not update


class Wrapping:
    """A schedule around another (``inner``): its counters beside the inner one's in one state dict."""

    inner: Schedule
    COUNTERS: tuple[str, ...] = ()

    def state_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.COUNTERS}, **self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        own = {k: v for k, v in state.items() if k in self.COUNTERS}
        self.inner.load_state_dict({k: v for k, v in state.items() if k not in self.COUNTERS})
        load_counters(self, own, self.COUNTERS)

    def in_flight(self) -> bool:
        return self.inner.in_flight()


@dataclass
class AccumulationSchedule(Wrapping):
    """``steps - 1`` micro-steps that only accumulate, then one step of the inner schedule's choice.

    The inner schedule (LocalSGD's, say) sees one step per cycle: it counts updates, not calls.
    """

    inner: Schedule
    steps: int
    micro_step: int = 0

    COUNTERS = ("micro_step",)

    @property
    def variants(self) -> tuple[str, ...]:
        return (ACCUMULATE, *self.inner.variants)

    def variant(self) -> str:
        return ACCUMULATE if self.micro_step < self.steps - 1 else self.inner.variant()

    def observe(self, variant: str, metrics: dict[str, float], lr: float) -> None:
        if variant == ACCUMULATE:
            self.micro_step += 1
            return
        self.micro_step = 0
        self.inner.observe(variant, metrics, lr)

    def settings(self) -> dict:
        return {"accumulate_steps": self.steps, **self.inner.settings()}


def continuous_freeze_cycle(groups: int, freeze_p: float) -> list[int]:
    """Boost's continuous rule: ``int(p*(n-1)/(1-p) + 0.5)`` zeros, then 1 .. n-1, repeated."""
    zeros = int(freeze_p * (groups - 1) / (1 - freeze_p) + 0.5)
    return [0] * zeros + list(range(1, groups))


@dataclass
class FreezeSchedule(Wrapping):
    """MindSpore Boost's gradient-freeze index per optimizer step; the variant is ``<inner>/freeze<i>``.

    Index ``i`` freezes groups ``0..i-1``. ``freeze_type=0`` (continuous)
    repeats :func:`continuous_freeze_cycle`. ``freeze_type=1`` (interval)
    starts with 0; afterwards, while the share of freezing steps so far is
    below ``1 - freeze_p`` it draws ``i`` from ``n-1, ..., 1`` with weights
    ``1, ..., n-1`` (small indices likelier), else takes 0. Draws use a
    generator seeded from ``(seed, step)``, the same on every rank and after a
    resume. An accumulation cycle keeps one index: the counter advances on
    steps that update.
    """

    inner: Schedule
    groups: int
    freeze_type: int
    freeze_p: float
    seed: int
    freeze_step: int = 0
    zero_steps: int = 0
    freezing_steps: int = 0

    COUNTERS = ("freeze_step", "zero_steps", "freezing_steps")

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(f"{v}/freeze{i}" for v in self.inner.variants for i in range(self.groups))

    def index(self) -> int:
        if self.groups <= 1:
            return 0
        if self.freeze_type == 0:
            cycle = continuous_freeze_cycle(self.groups, self.freeze_p)
            return cycle[self.freeze_step % len(cycle)]
        if self.freeze_step == 0:
            return 0
        if self.freezing_steps / (self.zero_steps + self.freezing_steps) >= 1 - self.freeze_p:
            return 0
        draw = random.Random(f"freeze:{self.seed}:{self.freeze_step}")
        return draw.choices(range(self.groups - 1, 0, -1), weights=range(1, self.groups))[0]

    def variant(self) -> str:
        return f"{self.inner.variant()}/freeze{self.index()}"

    def observe(self, variant: str, metrics: dict[str, float], lr: float) -> None:
        inner, _, index = variant.rpartition("/freeze")
        self.inner.observe(inner, metrics, lr)
        if inner == ACCUMULATE:
            return
        if int(index) == 0:
            self.zero_steps += 1
        else:
            self.freezing_steps += 1
        self.freeze_step += 1

    def settings(self) -> dict:
        own = {"freeze_groups": self.groups, "freeze_type": self.freeze_type, "freeze_p": self.freeze_p}
        return {**own, "freeze_seed": self.seed, **self.inner.settings()}


class StepCounter:
    """A schedule whose one counter is the steps it has seen (``step``), which picks the variant."""

    step: int
    COUNTERS = ("step",)

    def observe(self, variant: str, metrics: dict[str, float], lr: float) -> None:
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        load_counters(self, state, self.COUNTERS)

    def in_flight(self) -> bool:
        return False


@dataclass
class RoundRobinSchedule(StepCounter):
    """SINGA's partial update: step ``t`` (from 0) runs variant ``sync<t mod partitions>``."""

    partitions: int
    step: int = 0

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(f"sync{i}" for i in range(self.partitions))

    def variant(self) -> str:
        return f"sync{self.step % self.partitions}"

    def settings(self) -> dict:
        return {"partitions": self.partitions}


@dataclass
class DiLoCoSchedule(StepCounter):
    """DiLoCo: step ``t`` (from 1) runs ``"sync"`` when ``t`` is a multiple of ``sync_every`` (H), else ``"inner"``:
    H inner steps per outer round, the last of them followed by the sync."""

    sync_every: int
    step: int = 0

    variants = ("inner", "sync")

    def variant(self) -> str:
        return "sync" if (self.step + 1) % self.sync_every == 0 else "inner"

    def settings(self) -> dict:
        return {"sync_every": self.sync_every}


@dataclass
class StreamingDiLoCoSchedule(StepCounter):
    """Streaming DiLoCo: fragment ``p`` starts its exchange at the steps ``t`` (from 1) with
    ``t ≡ o_p (mod H)``, ``o_p = (p + 1) * H // P``, so the fragments sync in turn, each once per ``H`` steps, the
    last at multiples of ``H``. Variant ``sync<p>`` starts it (with ``delay`` 0 it also finishes it), and
    ``apply<p>`` finishes it ``delay`` (τ) steps later, after that step's inner update; every other step is
    ``"inner"``. ``delay`` must be below the smallest gap between two starts, so at most one fragment is in flight
    at any step and no step both starts and finishes one."""

    sync_every: int
    fragments: int
    delay: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        if self.fragments > self.sync_every:
            raise ConfigurationError(
                f"fragments={self.fragments} cannot each sync once in sync_every={self.sync_every} steps at "
                "different steps; use at most sync_every fragments."
            )
        gap = min(b - a for a, b in zip(self.offsets, [*self.offsets[1:], self.offsets[0] + self.sync_every]))
        if self.delay >= gap:
            raise ConfigurationError(
                f"fragment_sync_delay={self.delay}: fragments start their exchanges {gap} step(s) apart at the "
                f"closest (sync_every={self.sync_every}, fragments={self.fragments}), and an exchange must finish "
                f"before the next starts (one in flight at a time); use a delay below {gap}."
            )

    @property
    def offsets(self) -> list[int]:
        return [(p + 1) * self.sync_every // self.fragments for p in range(self.fragments)]

    @property
    def variants(self) -> tuple[str, ...]:
        per = [(f"sync{p}", f"apply{p}") if self.delay else (f"sync{p}",) for p in range(self.fragments)]
        return ("inner", *(v for pair in per for v in pair))

    def variant(self) -> str:
        return self.at(self.step + 1)

    def at(self, t: int) -> str:
        """The variant of step ``t`` (from 1)."""
        for p, offset in enumerate(self.offsets):
            if t >= offset and (t - offset) % self.sync_every == 0:
                return f"sync{p}"
            started = t - self.delay
            if self.delay and started >= offset and (started - offset) % self.sync_every == 0:
                return f"apply{p}"
        return "inner"

    def in_flight(self) -> bool:
        """Whether a fragment's exchange started and is not yet applied: one of the next τ steps applies it."""
        return any(self.at(self.step + j).startswith("apply") for j in range(1, self.delay + 1))

    def settings(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": self.fragments, "fragment_sync_delay": self.delay}
