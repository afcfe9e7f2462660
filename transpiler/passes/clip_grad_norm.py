"""``clip-grad-norm``: ``torch.nn.utils.clip_grad_norm_`` on the gradients the optimizer reads.

Requires: gradients as the optimizer will read them (after the reducing pass,
after ``loss-scale``, after ``accumulate-grads``).
Guarantees: with ``n_i = _foreach_norm(g, norm-type)[i]`` over every gradient (the CPU path of
``clip_grad_norm_``),
``total = vector_norm(stack(n_i), norm-type)`` and
``coef = min(max-norm * reciprocal(total + 1e-6), 1)``, each gradient is
``g_i * coef``: the ops ``clip_grad_norm_`` runs, in its order. After a
reduction every rank holds the same gradients, so the norm is the global
norm of the averaged gradient and identical on every rank (no extra
communication). ``total`` comes out as the metric ``grad_norm``. With loss
scaling the gradients are already unscaled; on an overflow step the norm is
inf or NaN and the update is skipped anyway.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from transpiler.graph.edit import Cursor, position, repair_order
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import Port, StepProgram

from .gradient_flow import add_outputs, optimizer_gradients, retarget_optimizer_input

aten = torch.ops.aten
EPS = 1e-6  # clip_grad_norm_'s guard against a zero norm


@dataclass(frozen=True)
class ClipGradNorm(Pass):
    name = "clip-grad-norm"
    summary = "clip the gradients the optimizer reads to a global norm (clip_grad_norm_)"
    max_norm: float = option(1.0, minimum=0, help="the largest total norm the gradients may have")
    norm_type: float = option(2.0, minimum=1e-30, kind=float, words=(("inf", float("inf")),), help="p of the p-norm")

    def run(self, program: StepProgram) -> bool:
        if any(n.meta.get("clip") for n in program.graph.nodes):
            return False
        grads = optimizer_gradients(program)
        if not grads:
            return False
        order = position(program.graph)
        cursor = Cursor(program.graph, max(grads.values(), key=order.__getitem__))
        listed = list(grads.values())
        per_tensor = cursor.emit(
            aten._foreach_norm.Scalar, (listed, self.norm_type), role="optimizer", inspects=True
        )  # what clip_grad_norm_ runs on CPU
        norms = [cursor.emit(operator.getitem, (per_tensor, i), role="optimizer") for i in range(len(listed))]
        stacked = cursor.emit(aten.stack.default, (norms,), role="optimizer")
        total = cursor.emit(aten.linalg_vector_norm.default, (stacked, self.norm_type), role="optimizer", clip=True)
        guarded = cursor.emit(aten.add.Tensor, (total, EPS), role="optimizer")
        coef = cursor.emit(aten.reciprocal.default, (guarded,), role="optimizer")
        coef = cursor.emit(aten.mul.Tensor, (coef, self.max_norm), role="optimizer")
        coef = cursor.emit(aten.clamp.default, (coef, None, 1.0), role="optimizer")
        for grad in grads.values():
            clipped = cursor.emit(aten.mul.Tensor, (grad, coef), role="optimizer", clip=True)
            retarget_optimizer_input(grad, clipped)
        add_outputs(program, [total], [Port("metric", "grad_norm")])
        repair_order(program.graph)  # updates placed between reduced gradients now wait for the norm of all
        return True
