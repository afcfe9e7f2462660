"""What a call really allocates, from the profiler's allocation records: the check of the memory estimate.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the CPU allocator (and the
GPU's) with its size and time. Summed in time order they give the bytes held at each moment over those held when
the call began; the peak of that sum is what the call added at its worst. The CPU keeps no allocator statistics
of its own (``torch.cuda.max_memory_allocated`` is the GPU's), so on the CPU this is the measured peak.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def allocated_peak(call: Callable[[], object], device: str = "cpu") -> int:
    """The most bytes ``call`` held at once on ``device`` ("cpu" or "cuda") beyond what was held when it began."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        call()
    wanted = torch.device(device).type
    records = [
        e
        for e in profile.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name.lower() == wanted
    ]
    records.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for record in records:
        live += record.nbytes()
        peak = max(peak, live)
    return peak
