"""Which program variant runs at each step.

Most modes have one variant, ``"step"``. LocalSGD has two, ``"local"`` and
``"sync"``, and a schedule that picks one per step from a step counter that is
the same on every rank, so all ranks run the same graph without retracing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import CheckpointError


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
