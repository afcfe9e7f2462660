"""``loss-scale``: static or dynamic loss scaling with a rank-agreed overflow decision.

Requires: gradients as the optimizer will read them (run it after the
reducing pass, and after ``accumulate-grads``).
Guarantees: the loss-gradient seed is multiplied by the scale ``S`` (extra
state ``loss_scale.scale``, 0-d float32, starting at ``init-scale``). With
``apply`` (a step that updates): every gradient the optimizer reads is
multiplied by ``1/S`` (computed in float64 and rounded, as
``torch.amp.GradScaler`` does); ``overflow`` is whether any of them holds an
inf or NaN, summed over all ranks by one 4-byte all-reduce (as MindSpore
Boost does), so every rank takes the same decision (under a sharded
optimizer each rank sees only its slices: the all-reduce is what makes the
flag global); on overflow every parameter and optimizer-state output is its
input (``where``; a sharded parameter's input is its slice, and
``gather-params`` comes after), so the update is skipped exactly. With
``dynamic``, the scale then follows GradScaler's
rule with Boost's floor: on overflow ``S = max(S * backoff, min-scale)`` and
the growth counter restarts; otherwise the counter (extra state
``loss_scale.growth_tracker``) counts up and after ``growth-interval`` clean
steps in a row ``S = S * growth``. The metrics ``overflow`` (0 or 1) and
``loss_scale`` (the scale this step used) come out every step. Without
``apply`` (accumulation micro-steps) only the seed is scaled: accumulators
hold scaled gradients, unscaled once at the update, as with GradScaler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor, position
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import GROWTH_TRACKER, LOSS_SCALE, ExtraInit, Port
from transpiler.graph.program import StepProgram

from .gradient_flow import (
    add_outputs,
    add_state,
    before_output,
    fake_tensor,
    input_node,
    optimizer_gradients,
    output_values,
    retarget_optimizer_input,
    scale_seed,
    set_output_values,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class LossScale(Pass):
    name = "loss-scale"
    summary = "scale the loss gradient, unscale gradients, skip the update on inf/NaN on any rank, adapt the scale"
    init_scale: float = option(2.0**16, minimum=1e-30, help="the scale at the first step")
    dynamic: bool = option(True, help="adapt the scale (GradScaler's rule); false: a fixed scale")
    growth_factor: float = option(2.0, minimum=1.0, help="scale multiplier after growth-interval clean steps")
    backoff_factor: float = option(0.5, minimum=1e-30, maximum=1.0, help="scale multiplier on overflow")
    growth_interval: int = option(2000, minimum=1, help="clean steps in a row before the scale grows")
    min_scale: float = option(1.0, minimum=0, help="the scale never backs off below this (MindSpore Boost)")
    apply: bool = option(True, help="a step that updates; false (accumulation micro-steps): scale the seed only")

    @property
    def requires(self) -> frozenset[Fact]:  # unscales the gradients as reduced, before clipping reads them
        updating = {Fact.FUNCTIONAL, Fact.UNTOUCHED, Fact.UNFLATTENED, Fact.UPDATING}
        return frozenset(updating if self.apply else {Fact.FUNCTIONAL})

    @property
    def invalidates(self) -> frozenset[Fact]:
        return frozenset({Fact.UNTOUCHED} if self.apply else ())

    def run(self, program: StepProgram) -> bool:
        if any(p.name == LOSS_SCALE for p in program.inputs):
            return False
        initial = ExtraInit.scalar(self.init_scale, torch.float32)
        scale = add_state(program, LOSS_SCALE, fake_tensor(program, torch.float32), initial)
        scale_seed(program, scale, loss_scale="seed")
        if not self.apply:
            return True
        grads = optimizer_gradients(program)
        cursor = Cursor(program.graph, scale)
        inv = cursor.emit(aten._to_copy.default, (scale,), {"dtype": torch.float64}, role="optimizer")
        inv = cursor.emit(aten.reciprocal.default, (inv,), role="optimizer")
        inv = cursor.emit(aten._to_copy.default, (inv,), {"dtype": torch.float32}, role="optimizer")
        finite = []
        for grad in grads.values():
            cursor = Cursor(program.graph, grad)
            unscaled = cursor.emit(aten.mul.Tensor, (grad, inv), role="optimizer", loss_scale="unscale")
            retarget_optimizer_input(grad, unscaled)
            check = cursor.emit(aten.isfinite.default, (unscaled,), role="optimizer", inspects=True)
            finite.append(cursor.emit(aten.all.default, (check,), role="optimizer"))
        order = position(program.graph)
        cursor = Cursor(program.graph, max(finite, key=order.__getitem__))
        all_finite = cursor.emit(
            aten.all.default, (cursor.emit(aten.stack.default, (finite,), role="optimizer"),), role="optimizer"
        )
        flag = cursor.emit(aten.logical_not.default, (all_finite,), role="optimizer")
        flag = cursor.emit(aten._to_copy.default, (flag,), {"dtype": torch.float32}, role="optimizer")
        if program.world_size > 1:
            info = {"kind": "all_reduce", "flag": ("overflow",), "bytes": 4}
            total = cursor.emit(
                C10D.all_reduce.default, (flag, "sum", program.group_name), role="communication", collective=info
            )
            flag = cursor.emit(WAIT, (total,), role="communication")
        self._skip_on_overflow(program, flag)
        return True

    def _skip_on_overflow(self, program: StepProgram, flag) -> None:
        cursor = before_output(program)
        overflow = cursor.emit(aten.gt.Scalar, (flag, 0), role="optimizer")
        values = output_values(program)
        inputs = {n.meta.get("port"): n for n in program.graph.nodes if n.op == "placeholder"}
        # under a sharded optimizer a parameter's update starts from this rank's slice of it
        inputs |= {Port("param", n.meta["shard_of"]): n for n in program.graph.nodes if "shard_of" in n.meta}
        for i, port in enumerate(program.outputs):
            old = inputs.get(port)
            # State this step creates (the generic path's first step) has no old value; the runtime does not
            # keep state that a skipped step created, as eager's step() never ran.
            if port.kind in ("param", "state") and values[i].op != "placeholder" and old is not None:
                values[i] = cursor.emit(aten.where.self, (overflow, old, values[i]), role="optimizer")
        set_output_values(program, values)
        scale = input_node(program, Port("extra", LOSS_SCALE))
        new, ports = [overflow, scale], [Port("metric", "overflow"), Port("metric", "loss_scale")]
        if self.dynamic:
            zero = ExtraInit.scalar(0, torch.int64)
            tracker = add_state(program, GROWTH_TRACKER, fake_tensor(program, torch.int64), zero)
            counted = cursor.emit(aten.add.Tensor, (tracker, 1), role="optimizer")
            grow = cursor.emit(aten.ge.Scalar, (counted, self.growth_interval), role="optimizer")
            restart = cursor.emit(aten.logical_or.default, (overflow, grow), role="optimizer")
            zero = cursor.emit(aten.zeros_like.default, (tracker,), role="optimizer")
            new_tracker = cursor.emit(aten.where.self, (restart, zero, counted), role="optimizer")
            backed = cursor.emit(aten.mul.Tensor, (scale, self.backoff_factor), role="optimizer")
            backed = cursor.emit(aten.clamp_min.default, (backed, self.min_scale), role="optimizer")
            grown = cursor.emit(aten.mul.Tensor, (scale, self.growth_factor), role="optimizer")
            clean = cursor.emit(aten.where.self, (grow, grown, scale), role="optimizer")
            new_scale = cursor.emit(aten.where.self, (overflow, backed, clean), role="optimizer")
            new += [new_scale, new_tracker]
            ports += [Port("extra", LOSS_SCALE), Port("extra", GROWTH_TRACKER)]
        add_outputs(program, new, ports)
