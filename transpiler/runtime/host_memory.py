"""On the CPU, glibc keeps the memory a step frees for the next step, sized by the step's own program.

glibc gives a large freed block back to the kernel (``munmap``, or a trim of the top of its heap), so a buffer
that a step allocates and frees faults its pages in again in the next step: an 18 MiB gradient bucket is 4,600
minor page faults. The zero modes allocate such buffers every step (the all-to-all's receive buffers, the
gathered shards, ``zero2``'s buckets) and every mode some; which steps fault depends on the heap's layout, so
the cost comes and goes (docs/memory.md). The CUDA caching allocator keeps its freed blocks for the same
reason. On the CPU ``transpile()`` therefore raises glibc's ``M_MMAP_THRESHOLD`` above the program's largest
tensor and ``M_TRIM_THRESHOLD`` above the most bytes its tensors hold at once (``graph/memory.py``), never
below glibc's own dynamic maxima (32 and 64 MiB on 64-bit). What glibc then keeps is about what the step
allocates at once, which every step reaches anyway: the process's peak stays within the noise of runs
(bench/host_memory.py), and between steps it holds those pages instead of the kernel. The thresholds are
process-wide and only ever raised.

Nothing is set where the user chose: glibc's ``MALLOC_*_`` variables or malloc tunables, another allocator in
``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc), a C library other than glibc, or
``transpile(..., keep_freed_memory=False)``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from transpiler.graph.memory import largest_allocation_bytes, peak_transient_bytes
from transpiler.graph.program import StepProgram

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MIB = 1024 * 1024
GLIBC_MMAP_MAX, GLIBC_TRIM_MAX = 32 * MIB, 64 * MIB  # glibc's dynamic thresholds at most (64-bit)
INT_MAX = (1 << 31) - 1  # mallopt takes an int
MARGIN = MIB  # above a threshold's bytes: malloc's own header, and a little slack
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_set: dict[int, int] = {}  # mallopt parameter -> the value this process set: only ever raised


def runs_on_cpu(programs: Iterable[StepProgram]) -> bool:
    """Whether every tensor the programs take lives in host memory."""
    values = [n.meta.get("val") for p in programs for n in p.graph.nodes if n.op == "placeholder"]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def keep_freed_memory(programs: Iterable[StepProgram]) -> str:
    """Raise glibc's thresholds so that what ``programs`` allocate and free stays in the process; what was
    done, in words (``program.decisions``)."""
    chosen = users_choice(os.environ)
    if chosen is not None:
        return f"glibc left as it is: {chosen}"
    mallopt = _mallopt()
    if mallopt is None:
        return f"nothing set: the C library is {platform.libc_ver()[0] or 'not glibc'}, not glibc"
    graphs = [p.graph for p in programs]
    largest = max(map(largest_allocation_bytes, graphs), default=0)
    peak = max(map(peak_transient_bytes, graphs), default=0)
    wanted = {
        M_MMAP_THRESHOLD: min(INT_MAX, max(GLIBC_MMAP_MAX, largest + MARGIN)),
        M_TRIM_THRESHOLD: min(INT_MAX, max(GLIBC_TRIM_MAX, 2 * peak + MARGIN)),
    }
    for parameter, value in wanted.items():
        if value > _set.get(parameter, 0) and mallopt(parameter, value) == 1:
            _set[parameter] = value
    trim, mmap = _set.get(M_TRIM_THRESHOLD, 0), _set.get(M_MMAP_THRESHOLD, 0)
    if not trim or not mmap:
        return "glibc refused the thresholds (mallopt returned 0): freed memory goes back to the kernel"
    return (
        f"glibc keeps up to {trim / MIB:.0f} MiB of freed memory for the next step (M_TRIM_THRESHOLD) and serves "
        f"tensors of up to {mmap / MIB:.0f} MiB from its heap (M_MMAP_THRESHOLD); the step holds "
        f"{peak / MIB:.1f} MiB of its own tensors at once at most, the largest {largest / MIB:.1f} MiB "
        "(keep_freed_memory=False leaves glibc as it is)"
    )


def users_choice(environ: Mapping[str, str]) -> str | None:
    """The allocator setting the user made in the environment, which the step leaves alone; None if none."""
    named = next((name for name in USER_SETTINGS if name in environ), None)
    if named is not None:
        return f"{named} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = environ.get("LD_PRELOAD", "")
    other = next((name for name in OTHER_ALLOCATORS if name in preload), None)
    return f"LD_PRELOAD loads {other}" if other is not None else None


@functools.cache
def _mallopt() -> Any:
    """glibc's ``mallopt``, or None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
