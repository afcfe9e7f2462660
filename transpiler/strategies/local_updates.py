"""The configs of the modes whose ranks update on their own and meet now and then: LocalSGD (every k steps,
adaptive k), and SINGA's partial update (one partition of the parameters averaged per step)."""

from __future__ import annotations

from dataclasses import dataclass

import passes

from .config import feature, knob, own
from .data_parallel import prefix, update
from .features import Accumulation, Compression
from .mode_config import ModeConfig, ModeName
from .schedules import LocalSGDSchedule, RoundRobinSchedule
from .strategy import Recipe


@dataclass(frozen=True, kw_only=True, repr=False)
class LocalSGD(ModeConfig):
    """Paddle's LocalSGD: local steps, the parameters averaged through snapshot deltas every ``k_steps`` steps (all
    of the first ``begin_step``); ``adaptive``: k follows Paddle's rule sqrt(lr_0·loss/(lr·loss_0)·k_steps), clipped
    to [1, 16], starting at ``k_steps``."""

    names = (
        ModeName(
            "local_sgd",
            "Paddle LocalSGD: local steps, parameters averaged through snapshot deltas every k_steps",
            {"adaptive": False},
        ),
        ModeName(
            "adaptive_local_sgd",
            "LocalSGD whose k follows Paddle's rule sqrt(lr_0*loss/(lr*loss_0)*init_k), clipped to [1, 16]",
            {"adaptive": True},
        ),
    )
    k_steps: int = own(1, minimum=1, help="synchronise every k steps (adaptive: k at the start)")
    adaptive: bool = own(False, help="adapt k after every sync by Paddle's rule")
    begin_step: int = own(1, minimum=0, help="steps 1..begin_step all synchronise (warm-up)")
    average_state: bool = knob(False, of="local-sgd-average")
    bucket_cap_mb: float = knob(25.0, of="local-sgd-average")
    first_bucket_mb: float = knob(1.0, of="local-sgd-average")
    compression: Compression | None = feature(Compression)
    accumulation: Accumulation | None = feature(Accumulation)

    def recipe(self) -> Recipe:
        average = passes.LocalSGDAverage(
            average_state=self.average_state,
            report_loss=self.adaptive,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
            wire_dtype=self.compression.wire_dtype if self.compression is not None else "none",
        )
        return Recipe(  # both variants flat, with the same buffers: the parameters stay bound across variants
            {"local": update(), "sync": [*update(), average, passes.ScheduleCollectives()]},
            prefix(),
            tail=[passes.ReinplaceOptimizer()],
            schedule=LocalSGDSchedule(k_steps=self.k_steps, begin_step=self.begin_step, adaptive=self.adaptive),
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class PartialSync(ModeConfig):
    """SINGA's partial update: local updates every step, one of ``partitions`` partitions of the parameters
    averaged per step, in turn."""

    names = (
        ModeName(
            "partial_sync",
            "SINGA partial update: local updates every step, one partition of the parameters averaged per step",
        ),
    )
    partitions: int = knob(2, of="partial-average")
    bucket_cap_mb: float = knob(25.0, of="partial-average")
    first_bucket_mb: float = knob(1.0, of="partial-average")

    def recipe(self) -> Recipe:
        caps = {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_mb": self.first_bucket_mb}
        return Recipe(
            {
                f"sync{i}": [
                    passes.PartialAverage(partitions=self.partitions, index=i, **caps),
                    passes.ForeachUpdate(),  # after the average, which reads each parameter's new value
                    passes.ScheduleCollectives(),
                ]
                for i in range(self.partitions)
            },
            prefix(),
            tail=[passes.ReinplaceOptimizer()],
            schedule=RoundRobinSchedule(self.partitions),
        )
