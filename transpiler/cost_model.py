"""The startup cost model behind ``bucket_cap_mb="auto"``: when each gradient is ready, what an all-reduce costs.

Measured once per traced program, on every rank, when a pass asks for it:

- **Gradient readiness**: a copy of the model runs forward and backward eagerly (twice, the second is
  timed) with a hook on every parameter; each hook stamps when that parameter's gradient exists,
  counted from the start of the backward. The backward's duration is stamped too.
- **All-reduce cost**: all-reduces of 4 KiB to 16 MiB on the step's own group, three timed after a
  warm-up, median per size, fitted by least squares to ``alpha + beta * bytes`` (latency, inverse
  bandwidth).

The ranks then take the element-wise maximum of everything measured (one all-reduce), so every rank
holds the same model and picks the same buckets. ``fuse-allreduce`` simulates each candidate pair of
caps on it: buckets (as ``assign_buckets`` forms them) are issued when their last gradient is ready and
reduced one at a time on one channel; the pair whose last all-reduce ends first wins, the fewest buckets
among those within 2% of the best. What the model leaves out (said in docs/performance.md): on a CPU,
communication takes cores from compute, so overlap is not free there; the model assumes it is, as on a GPU.
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
PROBE_ELEMENTS = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # float32: 4 KiB .. 16 MiB


@dataclass(frozen=True)
class CostModel:
    """What the ranks agreed on: all-reduce latency (s) and seconds per byte, each gradient's ready time (s
    from the start of the backward) and the backward's duration."""

    alpha: float
    beta: float
    ready: dict[str, float]
    backward: float

    def all_reduce_seconds(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    def finish(self, buckets: list[list[int]], names: list[str], nbytes: list[int]) -> float:
        """When the last all-reduce ends, buckets issued in order once their last gradient is ready."""
        free = 0.0
        for bucket in buckets:
            issue = max(self.ready.get(names[i], self.backward) for i in bucket)
            free = max(issue, free) + self.all_reduce_seconds(sum(nbytes[i] for i in bucket))
        return max(free, self.backward)


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
    local = torch.tensor([len(names), -len(names), *probes, backward, *ready], dtype=torch.float64, device=device)
    agreed = _all_reduce(local, "max", group_name).tolist()
    if agreed[0] != -agreed[1]:
        raise ConfigurationError(
            "bucket_cap_mb='auto': the ranks' models differ in how many parameters train "
            f"({int(-agreed[1])} to {int(agreed[0])}); start every rank with the same model."
        )
    timings = agreed[2 : 2 + len(probes)]
    alpha, beta = fit_alpha_beta([4.0 * n for n in PROBE_ELEMENTS], timings)
    rest = agreed[2 + len(probes) :]
    return CostModel(alpha, beta, dict(zip(names, rest[1:])), rest[0])


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


def _backward_times(model: torch.nn.Module, loss_fn, batch: tuple) -> tuple[list[str], list[float], float]:
    """Each trainable parameter's gradient-ready time and the backward's duration, on a copy of the model."""
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
    try:
        for _ in range(2):  # the first run warms up allocators and kernels
            stamps.clear()
            out = twin(*batch[:-1]) if loss_fn is not None else twin(*batch)
            loss = loss_fn(out, batch[-1]) if loss_fn is not None else out
            _synchronize(device)
            start = time.perf_counter()
            torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            _synchronize(device)
            end = time.perf_counter()
    finally:
        for handle in handles:
            handle.remove()
    names = [n for n, _ in params]
    return names, [stamps.get(n, end) - start for n in names], end - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
