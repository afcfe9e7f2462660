"""``step.memory_report()``: the bytes a rank holds between steps, counted from the tensors it holds.

Each storage is counted once, in the first category that holds it (a gradient that is a view of a bucket
buffer counts with the buffer; a tied parameter once). Between steps a rank holds its model's parameters
(trainable and frozen), gradients (``.grad`` where set, the persistent bucket buffers of the programs, and
the accumulators of gradient accumulation, whole or a sharded mode's slices), the optimizer state
(``optimizer.state``, a sharded mode's slices as they are) and the other state passes added (residuals, the
loss scale). The peak during the last step is the CUDA allocator's where the
model is on a GPU; on a CPU, which keeps no such count, it is what is held plus the batch plus the most bytes
the program's own tensors hold at once (``graph/memory.py``), and the report says which.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.memory import mib_table, peak_transient_bytes
from transpiler.graph.ports import ACCUMULATOR
from transpiler.graph.program import StepProgram

from .step_state import StepState


@dataclass(frozen=True)
class LastRun:
    """What the report needs of the last step: its program, the batch's bytes, the CUDA allocator's peak."""

    program: StepProgram
    batch_bytes: int
    cuda_peak: int | None

    @classmethod
    def of(cls, program: StepProgram, batch: tuple, cuda_peak: int | None) -> LastRun:
        return cls(program, sum(t.numel() * t.element_size() for t in batch), cuda_peak)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank holds between steps, by kind, and the peak during the last step."""

    parameters: int
    gradients: int
    optimizer_state: int
    transpiler_state: int
    peak: int
    peak_source: str  # "cuda allocator" or "program schedule"

    @property
    def held(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.transpiler_state

    def __str__(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("transpiler state", self.transpiler_state),
            ("held between steps", self.held),
            (f"peak in the last step ({self.peak_source})", self.peak),
        ]
        return mib_table(rows, width=44)


class StorageCounter:
    """Sums storage bytes, each storage once across every call."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def count(self, tensors: Iterable[object]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def bucket_buffers(programs: Iterable) -> list[torch.Tensor]:
    """The persistent gradient bucket buffers the programs hold (constants tagged with their bucket)."""
    return [
        getattr(program.graph_module, node.target)
        for program in programs
        for node in program.graph.nodes
        if node.op == "get_attr" and node.meta.get("bucket") is not None
    ]


def memory_report(state: StepState, last: LastRun | None) -> MemoryReport:
    """The bytes this rank holds between steps, each storage once, and the peak during the ``last`` step."""
    if last is None or state.built is None:
        raise ConfigurationError("run a step first: the report's peak is the last step's.")
    counter = StorageCounter()
    params = list(state.model.parameters())
    accumulators = [t for k, t in state.extra.items() if k.startswith(ACCUMULATOR)]
    held = {
        "parameters": counter.count(params),
        "gradients": counter.count(
            [p.grad for p in params] + bucket_buffers(state.built.programs.values()) + accumulators
        ),
        "optimizer_state": counter.count(t for s in state.optimizer.state.values() for t in s.values()),
        # where the model is: an offloaded θ_global (DiLoCo's offload_global) is host memory, not the device's
        "transpiler_state": counter.count(t for t in state.extra.values() if t.device == params[0].device),
    }
    if last.cuda_peak is not None:
        return MemoryReport(**held, peak=last.cuda_peak, peak_source="cuda allocator")
    peak = sum(held.values()) + last.batch_bytes + peak_transient_bytes(last.program.graph)
    return MemoryReport(**held, peak=peak, peak_source="program schedule")
