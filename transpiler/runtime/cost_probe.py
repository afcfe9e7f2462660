"""Measures the cost model behind ``bucket_cap_mb="auto"``: when each gradient is ready, what an all-reduce costs;
and, for ZeRO-3's ``bucket_cap_mb="cost"``, what an all-gather costs (:func:`measure_link`).

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
holds the same model (``graph/cost_model.py``) and picks the same buckets. ``fuse-allreduce`` simulates
each candidate pair of caps on it (``passes/bucket_plan.py``). What it leaves out: how contention varies
with the bucket size and with what the backward computes at the time; one measured factor stands for all of it.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.cost_model import CostModel, LinkCost, fit_alpha_beta

TIMED_RUNS = 3  # backward timings per measurement; their median is kept
PROBE_ELEMENTS = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # float32: 4 KiB .. 16 MiB


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


def measure_link(device: torch.device, group_name: str, world_size: int) -> LinkCost:
    """What an all-gather costs on ``group_name``: all-gathers of 4 KiB to 16 MiB (the gathered bytes), the
    median of five timed after a warm-up per size; the ranks agree on the element-wise maximum of their timings.
    ``beta`` is the slope between the two largest sizes and ``alpha`` what the smallest costs beyond its bytes:
    a least-squares intercept would carry the large sizes' noise into ``alpha``, which their timings swamp.
    Measured once per group in a process (a second step on the same group reuses it), so that steps built one
    after another in a process cut the same gather units."""
    key = (group_name, str(device), world_size)
    if key not in _LINKS:
        timings = [_all_gather_seconds(n, device, group_name, world_size) for n in PROBE_ELEMENTS]
        agreed = _all_reduce(torch.tensor(timings, dtype=torch.float64, device=device), "max", group_name).tolist()
        nbytes = [4.0 * n for n in PROBE_ELEMENTS]
        beta = max((agreed[-1] - agreed[-2]) / (nbytes[-1] - nbytes[-2]), 0.0)
        _LINKS[key] = LinkCost(max(agreed[0] - beta * nbytes[0], 0.0), beta, overlaps=device.type != "cpu")
    return _LINKS[key]


_LINKS: dict[tuple[str, str, int], LinkCost] = {}  # (group, device, world size) -> the agreed cost, kept


def _all_gather_seconds(elements: int, device: torch.device, group_name: str, world_size: int) -> float:
    shard = torch.ones(max(elements // world_size, 1), device=device)
    gather = C10D.all_gather_into_tensor.default
    WAIT(gather(shard, world_size, group_name))  # warm-up: connections, buffers
    seconds = []
    for _ in range(5):
        _synchronize(device)
        start = time.perf_counter()
        WAIT(gather(shard, world_size, group_name))
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


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
