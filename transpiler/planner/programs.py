"""The step as this project's program runs it on a GPU, under each execution flag: what the planner needs to choose
``compile`` and ``cuda_graph``.

On a GPU an uncaptured step takes the longer of two clocks: the host's, launching every kernel from Python, and
the device's, running them. Captured (``cuda_graph=True``), the host launches one graph per step: the step takes
its device time plus a replay's own cost (the batch copied in, the host part, the input checks, the launch).
Compiled, Inductor fuses the pointwise work into fewer kernels; by how much is measured, not predicted (a compile
costs a minute or more on a 100M-parameter model, so a calibration compiles only when asked).

:func:`measure_programs` times the program without communication (mode ``none``: the step's compute as the
project runs it, its collectives priced by the cost model apart) uncaptured, captured, and compiled where asked:
the time per step, the device time and kernels per step (``torch.profiler``), the peak, and the first call's
seconds (tracing, the passes, the compile, the capture). :func:`step_seconds` prices the four flags from them:
compiled and captured is the only one not measured, the compiled program's device time plus the replay's cost
measured on the uncompiled one (its captured step less its device time). Where the captured program was not
measured (a cluster file written by hand), a replay costs ``REPLAY_FIXED`` plus ``REPLAY_PER_KERNEL`` a kernel:
bench/gpu.py's captured rows on an H200 less the same program's device time (2026-11-29: 0.6–1.1 ms over
81–1,531 kernels).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

from transpiler.api import transpile
from transpiler.runtime.execution import Execution
from transpiler.trace.optimizers import TWINS, as_optimizer

from .cluster import ProgramTimes

REPLAY_FIXED = 6e-4  # seconds a captured step adds whatever its size (module docstring)
REPLAY_PER_KERNEL = 3e-7  # and per kernel of the graph
ROUNDS, STEPS, WARMUP, PROFILED = 5, 5, 2, 3


def step_seconds(programs: dict[str, ProgramTimes], compile: bool, cuda_graph: bool) -> float | None:
    """A step's seconds under the flags (module docstring); None where the compiled program was not measured."""
    measured = None if compile and cuda_graph else programs.get(flags_key(compile, cuda_graph))
    if measured is not None:
        return measured.wall
    base = programs.get("compile" if compile else "default")
    if base is None:
        return None
    captured, default = programs.get("cuda_graph"), programs["default"]
    if captured is not None:
        return base.device + max(captured.wall - default.device, 0.0)
    return base.device + REPLAY_FIXED + REPLAY_PER_KERNEL * base.kernels


def flags_key(compile: bool, cuda_graph: bool) -> str:
    """The key of the measured program closest to these flags: ``"default"``, ``"cuda_graph"``, ``"compile"``
    (compiled and captured is priced from the compiled one: never measured)."""
    return "compile" if compile else "cuda_graph" if cuda_graph else "default"


def measure_programs(
    model: torch.nn.Module, optimizer, loss_fn, batch: tuple, compile: bool = False, autocast: torch.dtype | None = None
) -> dict[str, ProgramTimes]:
    """``{"default": ..., "cuda_graph": ..., "compile": ...}``: each program built on copies of the model and
    optimizer (the originals are untouched), its steps under ``autocast`` where given, as the user's loop would
    wrap them. Captured only on a GPU and for an optimizer a capture takes (SGD, Adam, AdamW); compiled only where
    ``compile``. The programs stay resident together and are timed in ``ROUNDS`` rounds that take them in turn, as
    bench/gpu.py times its variants (a machine's drift then moves them alike); each one's peak counts its own
    tensors and what was resident before it was built (the user's model), not its siblings'. On the CPU (a dry run)
    the device figures are 0."""
    cuda = any(p.is_cuda for p in model.parameters())
    optimizer = as_optimizer(optimizer)
    flags = ["default"] + ["cuda_graph"] * (cuda and type(optimizer) in TWINS) + ["compile"] * compile
    context = torch.autocast("cuda" if cuda else "cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    runs, first, resident = {}, {}, {}
    for flag in flags:
        before = _allocated(cuda)
        twin, inner = copy.deepcopy((model, optimizer))
        execution = Execution(compile=flag == "compile", cuda_graph=flag == "cuda_graph")
        step = transpile(twin, inner, "none", loss_fn, execution=execution)

        def run(step=step) -> None:
            with context:
                step(*batch)

        runs[flag], first[flag] = run, _seconds(run, cuda)
        resident[flag] = _allocated(cuda) - before
    times = _interleaved(runs, cuda)
    if not cuda:
        return {flag: ProgramTimes(times[flag], 0.0, 0.0, 0, first[flag]) for flag in flags}
    out = {}
    for flag, run in runs.items():
        kernels, device = profile_kernels(run)
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - sum(b for f, b in resident.items() if f != flag)
        out[flag] = ProgramTimes(times[flag], device, kernels, peak, first[flag])
    return out


def _allocated(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else 0


def _seconds(run, cuda: bool, calls: int = 1) -> float:
    """Seconds per call over ``calls`` calls, synchronised before and after on a GPU (one call: the first, with
    its tracing, the passes, a compile, the warm-up)."""
    torch.cuda.synchronize() if cuda else None
    start = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize() if cuda else None
    return (time.perf_counter() - start) / calls


def _interleaved(runs: dict, cuda: bool) -> dict[str, float]:
    """Seconds per call of each run: the median of ``ROUNDS`` rounds, each taking the runs in turn, ``WARMUP``
    untimed calls then ``STEPS`` timed ones."""
    rounds: dict[str, list[float]] = {flag: [] for flag in runs}
    for _ in range(ROUNDS):
        for flag, run in runs.items():
            for _ in range(WARMUP):
                run()
            rounds[flag].append(_seconds(run, cuda, STEPS))
    return {flag: statistics.median(times) for flag, times in rounds.items()}


def profile_kernels(run, steps: int = PROFILED) -> tuple[float, float]:
    """Kernels per step and their device seconds per step over ``steps`` calls of ``run`` (``torch.profiler``)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / steps, sum(e.device_time for e in kernels) / 1e6 / steps
