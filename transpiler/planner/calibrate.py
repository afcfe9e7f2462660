"""Measure a cluster under torchrun: each link level's collectives, and the model's step on every rank at once.

``transpiler calibrate FILE.py:FACTORY -o cluster.json``, launched by torchrun on every host. The hosts are
torchrun's nodes (``WORLD_SIZE / LOCAL_WORLD_SIZE``). Per level, on a group that spans it (the ranks of the first
host for ``host``; one rank of each host for ``network``), each collective the cost model prices is timed at
sizes from 4 KiB upward, three times after a warm-up (median), until one takes a quarter of a second or 16 MiB is
reached; ``alpha + beta * bytes`` is fitted by least squares and the ranks keep the element-wise maximum. The
model's forward, backward and update are timed on every rank at once (``CALIBRATION_RUNS`` runs, more where they
take under ``CALIBRATION_SECONDS``), so the compute carries the host's contention (two ranks on one core each take
about twice a rank's time alone); on a GPU, so is the project's program for it, uncaptured, captured and
(``--compile``) compiled (``planner/programs.py``). Rank 0 writes the cluster (``planner/cluster.py``), with the
link levels a group could not span given the bandwidth and latency of the slowest one measured.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from transpiler.errors import ConfigurationError
from transpiler.graph.cost_model import fit_alpha_beta

from .cluster import MIB, Cluster, ComputeTimes, Link, ProgramTimes
from .profile import measure_compute
from .programs import measure_programs

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)  # bytes of the tensor each rank holds
ENOUGH = 0.25  # seconds: a collective this slow ends the sweep (a slow link would take minutes at 16 MiB)
TIMEOUT = timedelta(seconds=120)
# the compute's timed runs. Each rank runs its own, not in step with the others: over four calibrations of each of
# bench/planner.py's three models (4 ranks on 2 cores), 21 unaligned runs came within 0–9% of the inner step of
# the project's own program timed beside them (MLP 24–26 ms against 21–26, GPT 129–133 against 133–135, llama
# 139–145 against 145–148); starting every run together after a barrier came 7–10% low (GPT, llama), and on the
# MLP, whose phases last a few of the scheduler's time slices, 15–35% low. A short step gets more runs, for
# ``CALIBRATION_SECONDS`` at least: the MLP's step (28 ms) varied by 10% between calibrations of 21 runs, 7% of 100
CALIBRATION_RUNS = 21
CALIBRATION_SECONDS = 3.0


def calibrate(
    factory: tuple,
    memory_mib: float,
    device: str = "cpu",
    ranks_per_host: int | None = None,
    compile: bool = False,
    autocast: torch.dtype | None = None,
) -> Cluster | None:
    """Measure (module docstring); rank 0 gets the cluster, the others None. Under torchrun the process group is
    made here (and ended) unless the caller made one; ``ranks_per_host`` defaults to torchrun's
    ``LOCAL_WORLD_SIZE``. On a GPU the program is timed too, compiled as well where ``compile``, every step
    under ``autocast`` where given (a dtype)."""
    started = not dist.is_initialized()  # a caller's group is left as it was
    if started:
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if name not in os.environ]
        if missing:
            raise ConfigurationError(
                f"calibrate runs under torchrun on every host ({', '.join(missing)} not set): torchrun --nnodes "
                "HOSTS --nproc-per-node RANKS -m transpiler.cli calibrate FILE.py:FACTORY -o cluster.json"
            )
        dist.init_process_group("gloo" if device == "cpu" else "nccl", timeout=TIMEOUT)
    world = dist.get_world_size()
    local = ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ConfigurationError(f"{world} ranks do not make hosts of {local} ranks each.")
    rank, hosts = dist.get_rank(), world // local
    # every rank builds every group, in the same order, as torch.distributed requires
    host_group = dist.new_group(list(range(min(local, world))), timeout=TIMEOUT) if local > 1 else None
    network_group = dist.new_group([h * local for h in range(hosts)], timeout=TIMEOUT) if hosts > 1 else None
    measured: dict[str, dict[str, tuple[float, float, int]]] = {}
    for level, group, size in (("host", host_group, local), ("network", network_group, hosts)):
        member = group is not None and dist.get_rank(group) >= 0
        fits = {kind: _sweep(kind, group, size, device) if member else [0.0] * len(SIZES) for kind in _KINDS}
        agreed = _agree(fits, device)
        measured[level] = {
            k: (*fit_alpha_beta(_sizes(v, size if k == "all_gather" else 1), _times(v)), size)
            for k, v in agreed.items()
            if _times(v)
        }
    model, optimizer, loss_fn, batch = factory
    dist.barrier()
    compute = measure_compute(model, optimizer, loss_fn, tuple(batch), autocast, CALIBRATION_RUNS, CALIBRATION_SECONDS)
    slowest = _agree_compute(compute, device)
    programs = {}
    if device == "cuda":
        dist.barrier()
        programs = _agree_programs(measure_programs(model, optimizer, loss_fn, tuple(batch), compile, autocast))
    if started:
        dist.destroy_process_group()
    if rank != 0:
        return None
    links = {level: _link(measured.get(level, {}), size) for level, size in (("host", local), ("network", hosts))}
    network = links["network"] or links["host"] or Link(bandwidth=1e9 / 8, latency=1e-4)
    return Cluster(
        hosts=hosts,
        ranks_per_host=local,
        memory_per_rank=int(memory_mib * MIB),
        host_link=links["host"] or network,
        network_link=network,
        device=device,
        compute=slowest,
        programs=programs,
    )


_KINDS = ("all_reduce", "all_gather", "all_to_all")


def _sweep(kind: str, group, ranks: int, device: str) -> list[float]:
    """Seconds per size (0 where the sweep stopped early)."""
    times = [0.0] * len(SIZES)
    for i, nbytes in enumerate(SIZES):
        slowest = torch.tensor([_time(kind, nbytes // 4, group, ranks, device)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # the group's ranks stop at the same size
        times[i] = slowest.item()
        if times[i] > ENOUGH:
            break
    return times


def _time(kind: str, elements: int, group, ranks: int, device: str) -> float:
    data = torch.ones(max(elements, ranks), device=device)
    out = torch.empty(data.numel() * ranks, device=device) if kind == "all_gather" else torch.empty_like(data)

    def once() -> None:
        if kind == "all_reduce":
            dist.all_reduce(data, group=group)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(out, data, group=group)
        else:
            dist.all_to_all_single(out, data[: data.numel() // ranks * ranks], group=group)

    once()
    seconds = []
    for _ in range(3):
        dist.barrier(group=group)
        start = time.perf_counter()
        once()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _agree(fits: dict[str, list[float]], device: str) -> dict[str, list[float]]:
    """The element-wise maximum over all ranks (non-members contribute zeros)."""
    flat = torch.tensor([t for kind in _KINDS for t in fits[kind]], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    values = flat.tolist()
    return {kind: values[i * len(SIZES) : (i + 1) * len(SIZES)] for i, kind in enumerate(_KINDS)}


def _sizes(times: list[float], ranks: int) -> list[float]:
    """The bytes each timing is for, as the cost model counts them: the whole tensor a collective reduces,
    exchanges or gathers (an all-gather's output, ``ranks`` times what each rank gives)."""
    return [float(s * ranks) for s, t in zip(SIZES, times) if t > 0]


def _times(times: list[float]) -> list[float]:
    return [t for t in times if t > 0]


def _agree_compute(compute: ComputeTimes, device: str) -> ComputeTimes:
    """The slowest rank's phases: the rank whose step is longest, not each phase's maximum over the ranks (the
    MLP of bench/planner.py at 4 ranks on 2 cores: the phases' maxima summed to 27.5–32.2 ms over three
    calibrations, the longest rank's step to 26.9–28.9, where the program's inner steps measured 26–30)."""
    values = torch.tensor([compute.forward, compute.backward, compute.update], dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size() * 3, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, values)
    rows = every.reshape(-1, 3)
    return ComputeTimes(*rows[rows.sum(1).argmax()].tolist(), under_load=True)


def _agree_programs(programs: dict[str, ProgramTimes]) -> dict[str, ProgramTimes]:
    """Each measured figure's maximum over the ranks (the slowest rank sets the step)."""
    values = torch.tensor([dataclasses.astuple(t) for t in programs.values()], dtype=torch.float64, device="cuda")
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {
        flag: ProgramTimes(*row[:3], int(row[3]), row[4]) for flag, row in zip(programs, values.tolist(), strict=True)
    }


def _link(measured: dict[str, tuple[float, float, int]], ranks: int) -> Link | None:
    """A level's link: its measured collectives, and a bandwidth and latency read off its all-reduce's fit (a
    ring moves 2(n−1)/n of the bytes in 2(n−1) rounds) for the collectives it did not measure."""
    if "all_reduce" not in measured or ranks < 2:
        return None
    alpha, beta, _ = measured["all_reduce"]
    share = 2 * (ranks - 1) / ranks
    return Link(bandwidth=share / beta if beta > 0 else 1e12, latency=alpha / (2 * (ranks - 1)), measured=measured)
