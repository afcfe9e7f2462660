"""The startup cost model behind ``bucket_cap_mb="auto"``: when each gradient is ready, what an all-reduce costs.

Measured once per traced program, on every rank, when a pass asks for it:

- **Gradient readiness**: a copy of the model runs forward and backward eagerly (a warm-up, then three
  timed runs whose median is kept) with a hook on every parameter; each hook stamps when that
  parameter's gradient exists, counted from the start of the backward. The backward's duration too.
- **All-reduce cost**: all-reduces of 4 KiB to 16 MiB on the step's own group, three timed after a
  warm-up, median per size, fitted by least squares to ``alpha + beta * bytes`` (latency, inverse
  bandwidth).
- **Contention**: the backward timed again while a 16 MiB all-reduce is in flight; how much longer it
  took, as a share of that all-reduce's time, is what overlapping costs the compute (near 1 on a CPU
  whose cores all compute, near 0 where collectives have their own engines).

The ranks then take the element-wise maximum of everything measured (one all-reduce), so every rank
holds the same model and picks the same buckets. ``fuse-allreduce`` simulates each candidate pair of
caps on it (``passes/bucket_plan.py``). What it leaves out: how contention varies with the bucket size and
with what the backward computes at the time; one measured factor stands for all of it.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch

from .collectives import C10D, WAIT
from .errors import ConfigurationError

MB = 1024 * 1024
TIMED_RUNS = 3  # backward timings per measurement; their median is kept
PROBE_ELEMENTS = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # float32: 4 KiB .. 16 MiB


@dataclass(frozen=True)
class CostModel:
    """What the ranks agreed on: all-reduce latency (s) and seconds per byte, each gradient's ready time (s
    from the start of the backward), the backward's duration, and ``contention``: the share of an
    all-reduce's time that overlapping it costs the backward (0 on a GPU whose collectives run on their own
    engines; near 1 on a CPU whose cores are all busy computing)."""

    alpha: float
    beta: float
    ready: dict[str, float]
    backward: float
    contention: float = 0.0

    def all_reduce_seconds(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    def finish(self, buckets: list[list[int]], names: list[str], nbytes: list[int]) -> float:
        """When backward and communication are both done. Buckets are issued in order once the backward has
        produced their last gradient and are reduced one at a time; while an all-reduce runs, the backward
        progresses at ``1 - contention`` of its speed."""
        t = work = free = 0.0
        for bucket in buckets:
            target = min(max(self.ready.get(names[i], self.backward) for i in bucket), self.backward)
            start = max(self._reach(t, work, free, target), free)
            work, t = self._work_at(t, work, free, start), start
            free = start + self.all_reduce_seconds(sum(nbytes[i] for i in bucket))
        return max(free, self._reach(t, work, free, self.backward))

    def _reach(self, t: float, work: float, busy_until: float, target: float) -> float:
        """The time the backward has done ``target`` seconds of work, from ``work`` done at ``t``, with an
        all-reduce running until ``busy_until``."""
        if target <= work:
            return t
        slow = 1.0 - self.contention
        if busy_until > t:
            gained = slow * (busy_until - t)
            if work + gained >= target:
                return t + (target - work) / slow
            t, work = busy_until, work + gained
        return t + target - work

    def _work_at(self, t: float, work: float, busy_until: float, later: float) -> float:
        slowed = max(min(later, busy_until) - t, 0.0)
        return work + (1.0 - self.contention) * slowed + max(later - max(busy_until, t), 0.0)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``seconds = alpha + beta * nbytes``, both kept non-negative."""
    mean_x, mean_y = statistics.fmean(nbytes), statistics.fmean(seconds)
    var = sum((x - mean_x) ** 2 for x in nbytes)
    beta = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(nbytes, seconds)) / var, 0.0) if var else 0.0
    return max(mean_y - beta * mean_x, 0.0), beta


def measure(model: torch.nn.Module, loss_fn, batch: tuple, group_name: str) -> CostModel:
    """Measure on this rank, then agree with the others (element-wise maximum)."""
    names, ready, backward = _backward_times(model, loss_fn, batch)
    device = next(model.parameters()).device
    probes = [_all_reduce_seconds(n, device, group_name) for n in PROBE_ELEMENTS]
    _, _, crowded = _backward_times(model, loss_fn, batch, during=(PROBE_ELEMENTS[-1], group_name))
    contention = min(max((crowded - backward) / min(probes[-1], crowded), 0.0), 1.0) if crowded > 0 else 0.0
    local = [len(names), -len(names), *probes, contention, backward, *ready]
    agreed = _all_reduce(torch.tensor(local, dtype=torch.float64, device=device), "max", group_name).tolist()
    if agreed[0] != -agreed[1]:
        raise ConfigurationError(
            "bucket_cap_mb='auto': the ranks' models differ in how many parameters train "
            f"({int(-agreed[1])} to {int(agreed[0])}); start every rank with the same model."
        )
    timings = agreed[2 : 2 + len(probes)]
    alpha, beta = fit_alpha_beta([4.0 * n for n in PROBE_ELEMENTS], timings)
    contention, backward, *rest = agreed[2 + len(probes) :]
    return CostModel(alpha, beta, dict(zip(names, rest)), backward, contention)


def _all_reduce(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return WAIT(C10D.all_reduce.default(tensor, op, group_name))


def _all_reduce_seconds(elements: int, device: torch.device, group_name: str, repeats: int = 3) -> float:
    data = torch.ones(elements, device=device)
    _all_reduce(data, "sum", group_name)  # warm-up: connections, buffers
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        _all_reduce(data, "sum", group_name)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _backward_times(
    model: torch.nn.Module, loss_fn, batch: tuple, during: tuple[int, str] | None = None
) -> tuple[list[str], list[float], float]:
    """Each trainable parameter's gradient-ready time and the backward's duration, on a copy of the model;
    with ``during=(elements, group)`` the timed backward runs while an all-reduce of that size is in flight."""
    twin = copy.deepcopy(model)
    params = [(n, p) for n, p in twin.named_parameters() if p.requires_grad]
    device = params[0][1].device
    stamps: dict[str, float] = {}

    def stamp(name: str):
        def hook(grad: torch.Tensor) -> None:
            _synchronize(device)
            stamps[name] = time.perf_counter()

        return hook

    handles = [p.register_hook(stamp(n)) for n, p in params]
    names = [n for n, _ in params]
    runs: list[list[float]] = []  # per timed run: each gradient's ready time, then the backward's duration
    try:
        for run in range(1 + TIMED_RUNS):  # the first run warms up allocators and kernels
            stamps.clear()
            out = twin(*batch[:-1]) if loss_fn is not None else twin(*batch)
            loss = loss_fn(out, batch[-1]) if loss_fn is not None else out
            _synchronize(device)
            start = time.perf_counter()
            pending = (
                C10D.all_reduce.default(torch.ones(during[0], device=device), "sum", during[1]) if during else None
            )
            torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            _synchronize(device)
            end = time.perf_counter()
            if pending is not None:
                WAIT(pending)
            if run:
                runs.append([stamps.get(n, end) - start for n in names] + [end - start])
    finally:
        for handle in handles:
            handle.remove()
    medians = [statistics.median(column) for column in zip(*runs)]  # robust to a run disturbed by other work
    return names, medians[:-1], medians[-1]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
