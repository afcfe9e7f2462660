"""``local-sgd-average``: LocalSGD's sync step, Paddle's op sequence as a graph rewrite.

Requires: a traced step whose optimizer updates each parameter locally (no
gradient reduction before it).
Guarantees: after the local update ``p'`` of each trainable parameter,
``delta = snapshot - p'``; the deltas are sum all-reduced in dtype/size buckets
(as ``fuse-allreduce`` does); ``p = snapshot - delta / world_size`` becomes the
new parameter and a copy of it the new snapshot. Snapshots are extra inputs and
outputs (``snapshot.<param>``), created as copies of the broadcast parameters.
With ``average-state``, optimizer state (all but Adam's step count) and
floating-point buffers are averaged in the same buckets; otherwise they stay
local. With ``report-loss``, the loss summed over ranks / world_size comes out
as the metric ``avg_loss`` (adaptive LocalSGD reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.collectives import C10D, WAIT
from transpiler.graph_edit import Cursor
from transpiler.options import option
from transpiler.pipeline import Pass
from transpiler.program import Port, StepProgram

from .bucketing import MB, bucket_cap_option, first_bucket_option, reduce_in_buckets

aten = torch.ops.aten


def add_input(program: StepProgram, port: Port, like: fx.Node) -> fx.Node:
    """A new placeholder after the existing ones, with its port (the runtime feeds inputs by port)."""
    last = [n for n in program.graph.nodes if n.op == "placeholder"][-1]
    with program.graph.inserting_after(last):
        node = program.graph.placeholder("".join(c if c.isalnum() else "_" for c in f"x_{port.name}"))
    node.meta.update(val=like.meta.get("val"), port=port)
    program.inputs.append(port)
    return node


@dataclass(frozen=True)
class LocalSGDAverage(Pass):
    name = "local-sgd-average"
    summary = "LocalSGD sync: average parameters through snapshot deltas (Paddle LocalSGD)"
    average_state: bool = option(False, help="also average optimizer state and floating-point buffers")
    report_loss: bool = option(False, help="also all-reduce the loss, for adaptive LocalSGD")
    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()

    def run(self, program: StepProgram) -> bool:
        if any(p.kind == "extra" and p.name.startswith("snapshot.") for p in program.inputs):
            return False
        output = program.graph.output_node()
        values = list(output.args[0])
        ports = list(program.outputs)
        scale = 1.0 / program.world_size
        items, targets = [], []  # what to all-reduce, and how to rebuild the output from the sum
        for i, port in enumerate(ports):
            node = values[i]
            if port.kind == "param":
                snapshot = add_input(program, Port("extra", f"snapshot.{port.name}"), node)
                program.extra_init[f"snapshot.{port.name}"] = ("copy_param", port.name)
                delta = Cursor(program.graph, node).emit(aten.sub.Tensor, (snapshot, node), role="communication")
                items.append((port.name, delta))
                targets.append((i, snapshot))
            elif self.average_state and port.kind in ("state", "buffer") and self._averaged(port, node):
                items.append((port.name, node))
                targets.append((i, None))
        reduced = reduce_in_buckets(
            program, items, int(self.bucket_cap_mb * MB), int(self.first_bucket_mb * MB), tag="deltas"
        )
        extra_values, extra_ports = [], []
        for (i, snapshot), total in zip(targets, reduced):
            cursor = Cursor(program.graph, total)
            mean = cursor.emit(aten.mul.Tensor, (total, scale), role="communication")
            if snapshot is None:
                values[i] = mean
                continue
            values[i] = cursor.emit(aten.sub.Tensor, (snapshot, mean), role="communication")
            extra_values.append(cursor.emit(aten.clone.default, (values[i],), role="communication"))
            extra_ports.append(Port("extra", f"snapshot.{ports[i].name}"))
        if self.report_loss:
            cursor = Cursor(program.graph, values[0])
            info = {"kind": "all_reduce", "metric": ("avg_loss",), "bytes": 4}
            total = cursor.emit(
                C10D.all_reduce.default, (values[0], "sum", program.group_name), role="communication", collective=info
            )
            waited = cursor.emit(WAIT, (total,), role="communication")
            extra_values.append(cursor.emit(aten.mul.Tensor, (waited, scale), role="communication"))
            extra_ports.append(Port("metric", "avg_loss"))
        output.args = (tuple(values + extra_values),)
        program.outputs = ports + extra_ports
        return True

    @staticmethod
    def _averaged(port: Port, node: fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.is_floating_point() and not port.name.endswith(".step")
