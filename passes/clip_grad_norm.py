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
communication). Under a sharded optimizer (``program.shards``) each rank holds
a slice of every gradient: ``n_i`` is then ``(sum over ranks of
norm(slice)^p)^(1/p)``, one all-reduce of the stacked partial sums (for the
inf-norm, a max), so the norm is global and the same on every rank; it differs
from ``clip_grad_norm_``'s in the last bits (another summation order).
On a pipeline stage (``program.stage``) each stage holds only its own gradients: the
stages' norms meet in model order by one all-reduce over the pipeline's group, where each stage gives its own
and zeros for the others', so ``total`` is the whole model's, as ``clip_grad_norm_`` computes it, on every stage.
``total`` comes out as the metric ``grad_norm``. With loss scaling the
gradients are already unscaled; on an overflow step the norm is inf or NaN
and the update is skipped anyway.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor, position, repair_order
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram

from .gradient_flow import add_outputs, optimizer_gradients, retarget_optimizer_input
from .sharded_norms import norms_over_ranks

aten = torch.ops.aten
EPS = 1e-6  # clip_grad_norm_'s guard against a zero norm


@dataclass(frozen=True)
class ClipGradNorm(Pass):
    name = "clip-grad-norm"
    requires = frozenset({Fact.FUNCTIONAL, Fact.UNFLATTENED, Fact.UPDATING})  # it rewrites what each update reads
    invalidates = frozenset({Fact.UNTOUCHED})
    summary = "clip the gradients the optimizer reads to a global norm (clip_grad_norm_)"
    max_norm: float = option(1.0, minimum=0, help="the largest total norm the gradients may have")
    norm_type: float = option(2.0, minimum=1e-30, kind=float, words=(("inf", float("inf")),), help="p of the p-norm")

    def run(self, program: StepProgram) -> bool:
        if any(n.meta.get("clip") for n in program.graph.nodes):
            return False
        grads = optimizer_gradients(program)
        if not grads and program.stage is not None:
            raise ConfigurationError(
                f"clip-grad-norm: pipeline stage {program.stage.rank} trains no parameters, and a global norm adds "
                "every stage's share. Give each stage a trained parameter, or leave clipping out."
            )
        if not grads:
            return False
        order = position(program.graph)
        cursor = Cursor(program.graph, max(grads.values(), key=order.__getitem__))
        if program.shards and program.world_size > 1:
            stacked = self._norms_from_shards(program, cursor, grads)
        else:
            stacked = cursor.emit(aten.stack.default, (self._norms(cursor, list(grads.values())),), role="optimizer")
        if program.stage is not None:
            stacked = self._over_stages(program, cursor, stacked, tuple(grads))
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

    def _norms(self, cursor: Cursor, grads: list[fx.Node]) -> list[fx.Node]:
        """Each gradient's norm, as ``clip_grad_norm_`` computes them on CPU (``_foreach_norm``)."""
        if not grads:
            return []
        per_tensor = cursor.emit(aten._foreach_norm.Scalar, (grads, self.norm_type), role="optimizer", inspects=True)
        return [cursor.emit(operator.getitem, (per_tensor, i), role="optimizer") for i in range(len(grads))]

    def _over_stages(self, program: StepProgram, cursor: Cursor, stacked: fx.Node, names: tuple[str, ...]) -> fx.Node:
        """Every stage's gradients' norms in model order, the same on every stage: each stage puts its own in its
        parameters' places and zeros in the others', and one all-reduce over the pipeline's group adds them (adding
        zeros is exact), so the total is ``clip_grad_norm_``'s over the whole model, bit for bit."""
        place = {name: i for i, name in enumerate(names)}
        entries = cursor.emit(aten.unbind.int, (stacked,), role="optimizer")
        zero = cursor.emit(aten.new_zeros.default, (stacked, []), role="optimizer")
        every = [
            cursor.emit(operator.getitem, (entries, place[name]), role="optimizer") if name in place else zero
            for name in program.pipeline_grads
        ]
        spread = cursor.emit(aten.stack.default, (every,), role="optimizer")
        size = len(every) * stacked.meta["val"].element_size()
        info = {"kind": "all_reduce", "norm": program.pipeline_grads, "bytes": size}
        reduced = cursor.emit(
            C10D.all_reduce.default, (spread, "sum", program.stage.group_name), role="communication", collective=info
        )
        return cursor.emit(WAIT, (reduced,), role="communication")

    def _norms_from_shards(self, program: StepProgram, cursor: Cursor, grads: dict[str, fx.Node]) -> fx.Node:
        """Each parameter's norm when every rank holds a slice of its gradient: the slices' norms to the
        power p, summed over the ranks by one all-reduce (for the inf-norm, their maximum), to the power 1/p."""
        unsharded = sorted(set(grads) - set(program.shards))
        if unsharded:
            raise ConfigurationError(
                f"clip-grad-norm: the gradients of {unsharded} are whole while the others are this rank's slices; "
                "a global norm needs every gradient sharded or none."
            )
        owned = [name for name in grads if program.shards[name][1] > program.shards[name][0]]
        local = dict(zip(owned, self._norms(cursor, [grads[n] for n in owned])))
        # an empty slice contributes nothing (and has no inf-norm): a zero
        norms = [
            local[n] if n in local else cursor.emit(aten.new_zeros.default, (g, []), role="optimizer", inspects=True)
            for n, g in grads.items()
        ]
        return norms_over_ranks(program, cursor, norms, self.norm_type, tuple(grads))
