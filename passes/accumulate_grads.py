"""``accumulate-grads``: gradient accumulation (Boost ``grad_accumulation``, DDP's ``no_sync``).

Requires: traced gradients not yet reduced (run it before the reducing pass); with ``reduced``, the reduced
gradients the optimizer reads (run it right after the reducing pass: this rank's slices under
``shard-optimizer``).
Guarantees: the loss-gradient seed is scaled by ``1/steps``, so ``steps``
micro-batches add up to the gradient of their mean loss; each gradient ``g``
becomes ``accum.<param> + g``, where ``accum.<param>`` is extra state that
starts at zero, shaped as ``g``. With ``apply`` (the last micro-step of a cycle) the sum goes on
to the reduction (or, ``reduced``, to the optimizer) as the gradient did, and the accumulator is
reset to zero; without it (the other micro-steps) the sum is the accumulator's
new value and the optimizer is removed, so parameters and optimizer state pass
through unchanged (dead code elimination drops the update). Unreduced, nothing is communicated in a
micro-step; ``reduced`` (ZeRO-2 and ZeRO-3, as DeepSpeed's stage 2) every micro-step reduces, and the
accumulators are this rank's slices: 1/W of the gradients instead of all of them. Buffers (BatchNorm
statistics) update every micro-step, as in eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.edit import Cursor
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import ACCUMULATOR, ExtraInit, Port
from transpiler.graph.program import StepProgram

from .gradient_flow import (
    add_outputs,
    add_state,
    before_output,
    gradient_nodes,
    keep_inputs,
    reads_raw_gradient,
    retarget_optimizer_input,
    scale_seed,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class AccumulateGrads(Pass):
    name = "accumulate-grads"
    summary = "gradient accumulation: micro-steps add into accumulators; the last one reduces and updates once"
    steps: int = option(2, minimum=1, help="micro-steps per optimizer update")
    apply: bool = option(True, help="this is the cycle's last micro-step (reduce and update); false: accumulate only")

    reduced: bool = option(
        False,
        help="accumulate the reduced gradients (this rank's slices under shard-optimizer; every micro-step "
        "communicates), after the reducing pass",
    )

    @property
    def requires(self) -> frozenset[Fact]:  # before the reduction; or, reduced, right after it
        done = Fact.REDUCED if self.reduced else Fact.UNREDUCED
        return frozenset({Fact.FUNCTIONAL, Fact.UNACCUMULATED, Fact.UNTOUCHED, Fact.UNFLATTENED, done})

    @property
    def ensures(self) -> frozenset[Fact]:  # a micro-step updates nothing: the parameters pass through whole
        return frozenset(() if self.apply else {Fact.WHOLE_PARAMETERS})

    @property
    def invalidates(self) -> frozenset[Fact]:  # a micro-step: the update goes (dead code elimination drops it)
        return frozenset({Fact.UNACCUMULATED} if self.apply else {Fact.UNACCUMULATED, Fact.UPDATING})

    def run(self, program: StepProgram) -> bool:
        if any(p.kind == "extra" and p.name.startswith(ACCUMULATOR) for p in program.inputs):
            return False
        if self.steps > 1:
            scale_seed(program, 1.0 / self.steps, accumulate_scale=1.0 / self.steps)
        new_values, new_ports = [], []
        for grad in _reduced_gradients(program) if self.reduced else gradient_nodes(program):
            name = grad.meta["reduced_grad_of"] if self.reduced else grad.meta.pop("grad_of")
            port = Port("extra", ACCUMULATOR + name)
            acc = add_state(program, port.name, grad, _zeros_like(grad) if self.reduced else ExtraInit.zeros_like(name))
            cursor = Cursor(program.graph, grad)
            if self.reduced:
                total = cursor.emit(aten.add.Tensor, (acc, grad), role="optimizer")
                retarget_optimizer_input(grad, total)
            else:
                total = cursor.emit(aten.add.Tensor, (acc, grad), role="backward", grad_of=name)
                grad.replace_all_uses_with(total, delete_user_cb=lambda u: not reads_raw_gradient(u))
            new_ports.append(port)
            new_values.append(total if not self.apply else acc)
        if self.apply:  # the accumulators restart from zero after the update
            cursor = before_output(program)
            new_values = [cursor.emit(aten.zeros_like.default, (acc,), role="optimizer") for acc in new_values]
        add_outputs(program, new_values, new_ports)
        if not self.apply:
            keep_inputs(program, ("param", "state"))
        return True


def _zeros_like(node: fx.Node) -> ExtraInit:
    """The initialisation rule for zeros shaped as ``node``'s value (a reduced slice, not a whole parameter)."""
    value = node.meta["val"]
    return ExtraInit.zeros(value.shape, value.dtype)


def _reduced_gradients(program: StepProgram) -> list[fx.Node]:
    return [n for n in program.graph.nodes if "reduced_grad_of" in n.meta]
