"""``local-sgd-average``: LocalSGD's sync step, Paddle's op sequence as a graph rewrite.

Requires: a traced step whose optimizer updates each parameter locally (no
gradient reduction before it).
Guarantees: after the local update ``p'`` of each trainable parameter, ``delta = snapshot - p'``;
the deltas are sum all-reduced in dtype/size buckets (as ``fuse-allreduce`` does); ``p = snapshot -
delta / world_size`` becomes the new parameter and a copy of it the new snapshot. Snapshots are
extra inputs and outputs (``snapshot.<param>``), created as copies of the broadcast parameters.
Parameters that ``flatten-update`` made flat (it runs first) are averaged a flat buffer at a time:
the buffer as the update wrote it, against a flat snapshot laid out as it (a ``flat`` input
``snapshot.<buffer>`` whose views the runtime binds to the snapshots ``snapshot.<param>``), both
written back in place; the same arithmetic per element, one all-reduce per buffer. With
``average-state``, optimizer state (all but Adam's step count) and floating-point buffers are averaged in the
same buckets (a flat state buffer whole); otherwise they stay local. With ``wire-dtype=fp16|bf16``
each delta is first multiplied by ``1/world_size`` (so the half-precision sum cannot overflow), then
reduced in half precision and cast back, and the mean is that sum. With ``report-loss``, the loss
summed over ranks / world_size comes out as the metric ``avg_loss`` (adaptive LocalSGD reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import SNAPSHOT, ExtraInit, Port
from transpiler.graph.program import FlatBuffer, StepProgram

from .bucketing import WIRE, bucket_cap_option, caps_in_bytes, first_bucket_option, reduce_in_buckets, wire_dtype_option
from .flat_writes import written_value
from .gradient_flow import add_input, add_state, before_output, input_node

aten = torch.ops.aten


@dataclass(frozen=True)
class LocalSGDAverage(Pass):
    name = "local-sgd-average"
    requires = frozenset({Fact.FUNCTIONAL, Fact.UNREDUCED})
    invalidates = frozenset({Fact.UPDATED_LOCALLY})  # the new values are averaged across ranks
    summary = "LocalSGD sync: average parameters through snapshot deltas (Paddle LocalSGD)"
    average_state: bool = option(False, help="also average optimizer state and floating-point buffers")
    report_loss: bool = option(False, help="also all-reduce the loss, for adaptive LocalSGD")
    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()
    wire_dtype: str = wire_dtype_option()

    def run(self, program: StepProgram) -> bool:
        if any(p.kind in ("extra", "flat") and p.name.startswith(SNAPSHOT) for p in program.inputs):
            return False
        output = program.graph.output_node()
        values = list(output.args[0])
        ports = list(program.outputs)
        scale = 1.0 / program.world_size
        wire = WIRE[self.wire_dtype]
        items, targets = [], []  # what to all-reduce, and how to rebuild the output from the sum
        flat = self._flat_items(program, scale, wire)
        items += [(name, delta) for name, delta, _, _ in flat]
        for i, port in enumerate(ports):
            node = values[i]
            if port.kind == "param":
                snapshot = add_state(program, f"{SNAPSHOT}{port.name}", node, ExtraInit.copy_of(port.name))
                cursor = Cursor(program.graph, node)
                delta = cursor.emit(aten.sub.Tensor, (snapshot, node), role="communication")
                if wire is not None:  # share first: the half-precision sum is then the mean
                    delta = cursor.emit(aten.mul.Tensor, (delta, scale), role="communication")
                items.append((port.name, delta))
                targets.append((i, snapshot))
            elif self.average_state and port.kind in ("state", "buffer") and self._averaged(port, node):
                if wire is not None:
                    node = Cursor(program.graph, node).emit(aten.mul.Tensor, (node, scale), role="communication")
                items.append((port.name, node))
                targets.append((i, None))
        reduced = reduce_in_buckets(
            program, items, *caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb), tag="deltas", compress=wire
        )
        extra_values, extra_ports = [], []
        for (_, _, buffer, snapshot), total in zip(flat, reduced[: len(flat)]):
            cursor = Cursor(program.graph, total)
            mean = total if wire is not None else cursor.emit(aten.mul.Tensor, (total, scale), role="communication")
            new = mean if snapshot is None else cursor.emit(aten.sub.Tensor, (snapshot, mean), role="communication")
            cursor.emit(aten.copy_.default, (buffer, new), role="communication")
            if snapshot is not None:
                cursor.emit(aten.copy_.default, (snapshot, new), role="communication")
        reduced = reduced[len(flat) :]
        for (i, snapshot), total in zip(targets, reduced):
            cursor = Cursor(program.graph, total)
            mean = total if wire is not None else cursor.emit(aten.mul.Tensor, (total, scale), role="communication")
            if snapshot is None:
                values[i] = mean
                continue
            values[i] = cursor.emit(aten.sub.Tensor, (snapshot, mean), role="communication")
            extra_values.append(cursor.emit(aten.clone.default, (values[i],), role="communication"))
            extra_ports.append(Port("extra", f"{SNAPSHOT}{ports[i].name}"))
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

    def _flat_items(self, program: StepProgram, scale: float, wire) -> list[tuple[str, fx.Node, fx.Node, fx.Node]]:
        """For each flat buffer to average (the parameters'; with ``average-state`` also the state's but the step
        counts): its name, what to all-reduce (``snapshot - p'`` for parameters, the state itself), the buffer,
        and the parameters' snapshot (None for state)."""
        found = []
        for layout in list(program.flat_buffers):
            if layout.kind != "param" and (not self.average_state or layout.kind != "state" or layout.key == "step"):
                continue
            buffer = input_node(program, Port("flat", layout.port))
            cursor = before_output(program)
            value = written_value(program, buffer, 0, layout.length, cursor, role="communication")
            snapshot = None
            if layout.kind == "param":
                snapshot = self._flat_snapshot(program, layout, buffer)
                value = cursor.emit(aten.sub.Tensor, (snapshot, value), role="communication")
            if wire is not None:  # share first: the half-precision sum is then the mean
                value = cursor.emit(aten.mul.Tensor, (value, scale), role="communication")
            found.append((layout.port, value, buffer, snapshot))
        return found

    @staticmethod
    def _flat_snapshot(program: StepProgram, layout: FlatBuffer, buffer: fx.Node) -> fx.Node:
        """A flat input laid out as the parameters' buffer ``layout``, whose views the runtime binds to the
        snapshots ``snapshot.<parameter>`` (so checkpoints hold one per parameter, whatever the layout), each
        made by ``copy_param`` as the per-parameter path makes it."""
        port = f"{SNAPSHOT}{layout.port}"
        program.flat_buffers.append(replace(layout, port=port, kind="extra", key="snapshot"))
        for name in layout.names:
            program.extra_init[f"{SNAPSHOT}{name}"] = ExtraInit.copy_of(name)
        return add_input(program, Port("flat", port), buffer.meta["val"])

    @staticmethod
    def _averaged(port: Port, node: fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.is_floating_point() and not port.name.endswith(".step")
