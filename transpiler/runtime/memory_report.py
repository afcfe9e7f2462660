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

MIB = 1024 * 1024


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
        return "\n".join(f"{name:<44} {value / MIB:10.3f} MiB" for name, value in rows)


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
