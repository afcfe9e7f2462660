"""The recipes of the modes whose ranks update on their own and meet now and then: LocalSGD (every k steps,
adaptive k), and SINGA's partial update (one partition of the parameters averaged per step)."""

from __future__ import annotations

from .data_parallel import prefix, update
from .options import make
from .schedules import LocalSGDSchedule, RoundRobinSchedule
from .strategy import Recipe


def _local_sgd(
    adaptive: bool, k: int, begin_step: int, average_state: bool, cap: float, first: float, compress: str
) -> Recipe:
    average = make(
        "local-sgd-average",
        average_state=average_state,
        report_loss=adaptive,
        bucket_cap_mb=cap,
        first_bucket_mb=first,
        compress=compress,
    )
    return Recipe(  # both variants flat, with the same buffers: the parameters stay bound across variants
        {"local": update(), "sync": [*update(), average, make("schedule-collectives")]},
        prefix(),
        tail=[make("reinplace-optimizer")],
        schedule=LocalSGDSchedule(k_steps=k, begin_step=begin_step, adaptive=adaptive),
    )


def local_sgd(k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress) -> Recipe:
    return _local_sgd(False, k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress)


def adaptive_local_sgd(init_k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress) -> Recipe:
    return _local_sgd(True, init_k_steps, begin_step, average_state, bucket_cap_mb, first_bucket_mb, compress)


def partial_sync(partitions: int, bucket_cap_mb: float, first_bucket_mb: float) -> Recipe:
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": first_bucket_mb}
    return Recipe(
        {
            f"sync{i}": [
                make("partial-average", partitions=partitions, index=i, **caps),
                make("foreach-update"),  # after the average, which reads each parameter's new value
                make("schedule-collectives"),
            ]
            for i in range(partitions)
        },
        prefix(),
        tail=[make("reinplace-optimizer")],
        schedule=RoundRobinSchedule(partitions),
    )
