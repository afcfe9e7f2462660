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

from transpiler.graph.edit import Cursor, node_bytes
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.program import StepProgram

from .bucketing import bucket_cap_option, caps_in_bytes, first_bucket_option, reduce_in_buckets
from .gradient_flow import output_values, set_output_values
from .partitions import check_part, partition_of

aten = torch.ops.aten


@dataclass(frozen=True)
class PartialAverage(Pass):
    name = "partial-average"
    requires = frozenset({Fact.FUNCTIONAL, Fact.UNREDUCED, Fact.UNFLATTENED})
    invalidates = frozenset({Fact.UPDATED_LOCALLY})  # the new values are averaged across ranks
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
        check_part("partitions", self.partitions, "partition", self.index, len(params))
        owner = partition_of([node_bytes(values[i]) for i, _ in params], self.partitions)
        chosen = [(i, port) for (i, port), part in zip(params, owner) if part == self.index]
        items = [(port.name, values[i]) for i, port in chosen]
        caps = caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb)
        scale = 1.0 / program.world_size
        for (i, _), total in zip(chosen, reduce_in_buckets(program, items, *caps, tag="params")):
            values[i] = Cursor(program.graph, total).emit(aten.mul.Tensor, (total, scale), role="communication")
        set_output_values(program, values)
        return bool(chosen)
