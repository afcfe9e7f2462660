"""``partial-average``: one variant of SINGA's partial update (``backward_and_partial_update``).

Requires: a step whose optimizer updates each parameter locally (no gradient
reduction).
Guarantees: the trainable parameters, in model order, are split into
``partitions`` consecutive partitions of near-equal bytes (a parameter goes
to partition ``floor(partitions * m / total)``, ``m`` the byte offset of its
middle, kept consecutive and no partition left empty). After the local update, the parameters of partition ``index`` are
sum all-reduced in dtype/size buckets and divided by the world size, as SINGA
does; every other parameter keeps its local update. The schedule runs index
``t mod partitions`` at step ``t``, so a cycle averages every parameter once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.edit import Cursor, node_bytes
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram

from .bucketing import MB, bucket_cap_option, first_bucket_option, reduce_in_buckets
from .gradient_flow import output_values, set_output_values

aten = torch.ops.aten


def partition_of(sizes: list[int], partitions: int) -> list[int]:
    """The partition of each item: consecutive, balanced by size, none empty when there are enough items.

    An item's balanced partition is where its middle falls in the cumulative size; it is then held
    within one step of the previous item's and early enough that every later partition still gets one.
    """
    total, n = sum(sizes) or 1, len(sizes)
    out: list[int] = []
    start = 0
    for i, size in enumerate(sizes):
        balanced = int(partitions * (start + size / 2) / total)
        previous = out[-1] if out else 0
        low = max(previous, partitions - (n - i)) if out else 0
        high = min(previous + 1, partitions - 1) if out else 0
        out.append(min(max(balanced, low), high))
        start += size
    return out


@dataclass(frozen=True)
class PartialAverage(Pass):
    name = "partial-average"
    summary = "average one partition of the parameters after the local update (SINGA partial update)"
    partitions: int = option(2, minimum=1, help="partitions of the parameters; one is averaged per step")
    index: int = option(0, minimum=0, help="the partition this variant averages")
    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()

    def run(self, program: StepProgram) -> bool:
        if any(n.meta.get("collective", {}).get("params") for n in program.graph.nodes):
            return False
        values = output_values(program)
        params = [(i, port) for i, port in enumerate(program.outputs) if port.kind == "param"]
        if self.partitions > len(params):
            raise ConfigurationError(
                f"partitions={self.partitions}, but the model has {len(params)} trainable parameters; "
                f"use at most {len(params)}."
            )
        if self.index >= self.partitions:
            raise ConfigurationError(f"partition {self.index} is not below partitions={self.partitions}.")
        owner = partition_of([node_bytes(values[i]) for i, _ in params], self.partitions)
        chosen = [(i, port) for (i, port), part in zip(params, owner) if part == self.index]
        items = [(port.name, values[i]) for i, port in chosen]
        cap, first = int(self.bucket_cap_mb * MB), int(self.first_bucket_mb * MB)
        scale = 1.0 / program.world_size
        for (i, _), total in zip(chosen, reduce_in_buckets(program, items, cap, first, tag="params")):
            values[i] = Cursor(program.graph, total).emit(aten.mul.Tensor, (total, scale), role="communication")
        set_output_values(program, values)
        return bool(chosen)
