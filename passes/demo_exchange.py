"""``demo-exchange``: DeMo, decoupled momentum optimisation (Peng et al., 2024), as its authors' ``DeMo``
optimizer computes it, as a gradient reduction.

Requires: gradient nodes tagged ``grad_of`` (not yet reduced), each rank's own (no ``scale-loss-grad``: the pass
takes the mean itself); an optimizer traced as ``torch.optim.SGD`` without momentum (DeMo's own class is one), whose
lr the momentum takes.
Guarantees: each rank adds its gradient into a momentum that is never sent, ``δ = β·δ + lr·g``
(``demo_momentum.<param>``, extra state starting at zero; ``lr`` the group's, from the step's scalar input). In
dtype/size buckets, each momentum is cut into tiles (``sparse_tiles.py``: each side the largest divisor of the
dimension not above ``chunk_size``); each tile's 2-D DCT coefficients (the authors' FFT-built bases, constants of the
program) go through the sparse exchange of ``sparse_pseudo_exchange``: the ``topk`` coefficients of largest
magnitude per tile, in float32 (or quantised with ``quantization_bins``), one all-gather per bucket. What was
sent leaves the momentum through the inverse DCT, and every rank averages each coefficient over the ranks that
sent it and returns the tiles to values. The optimizer reads that mean, or with ``sign`` its sign (DeMo's update),
as the gradient.
The momentum itself never leaves the rank: the verifier ``check_private_state_stays`` holds the pass to that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.edit import Cursor
from transpiler.graph.options import option
from transpiler.graph.ports import DEMO_MOMENTUM, ExtraInit, Port, PortKind, is_input
from transpiler.graph.program import StepProgram

from .bucketing import BucketedGradientPass
from .gradient_flow import add_constant, add_outputs, add_state, input_node, replace_gradient
from .sparse_pseudo_exchange import Sparsity, check_options, exchange
from .sparse_tiles import dct_bases

aten = torch.ops.aten


@dataclass(frozen=True)
class DeMoExchange(BucketedGradientPass):
    name = "demo-exchange"
    summary = "DeMo: local momentum, its top-k DCT coefficients per tile all-gathered, the decoded mean's sign"
    compression_decay: float = option(0.999, minimum=0, maximum=1, help="β of the local momentum δ = β·δ + lr·g")
    chunk_size: int = option(64, minimum=2, help="the most a tile's side takes (a divisor of the dimension)")
    topk: int = option(32, minimum=1, help="DCT coefficients sent per tile")
    quantization_bins: int = option(
        0, minimum=0, help="quantise the sent coefficients to this many bins per tensor (0: float32)"
    )
    quantization_range: float = option(6.0, minimum=0, help="the quantiser's range, in standard deviations")
    sign: bool = option(True, help="the optimizer steps on the sign of the decoded mean (DeMo); off: the mean")
    weight_decay: float = option(0.0, minimum=0, help="DeMo's decoupled weight decay: θ·(1 − lr·λ) before the step")
    inline_exchange: bool = option(
        False,
        help="top-k and decoding as calls Inductor compiles (compile=True); off: one op each",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_options(self.quantization_bins, "DeMo")

    def for_inductor(self) -> DeMoExchange:
        """The exchange inline, for Inductor to compile with the momentum update and the step."""
        return replace(self, inline_exchange=True)

    def reduce(self, program: StepProgram, grads: list[fx.Node]) -> None:
        bad = [g.meta["grad_of"] for g in grads if g.meta["val"].dtype != torch.float32]
        if bad:
            raise ConfigurationError(f"DeMo's momenta are float32; the gradients of {bad[:3]} are not.")
        bases: dict[int, tuple[fx.Node, fx.Node]] = {}

        def basis(side: int) -> tuple[fx.Node, fx.Node]:
            if side not in bases:
                forward, inverse = dct_bases(side)
                bases[side] = (
                    add_constant(program, f"dct_{side}", forward, role="communication"),
                    add_constant(program, f"idct_{side}", inverse, role="communication"),
                )
            return bases[side]

        rates = _learning_rates(program)
        left: dict[str, fx.Node] = {}
        sparsity = Sparsity(self.chunk_size, self.topk, False, self.quantization_bins, self.quantization_range)
        comm = {"role": "communication"}
        for index, members, cursor in self.buckets(program, grads):  # each op over the bucket's tensors at once
            names = [grads[i].meta["grad_of"] for i in members]
            before = [
                add_state(program, DEMO_MOMENTUM + n, grads[i], ExtraInit.zeros_like(n)) for n, i in zip(names, members)
            ]
            if self.compression_decay != 1.0:  # as the authors' optimizer: no multiply by 1
                before = cursor.emit_each(aten._foreach_mul.Scalar, (before, self.compression_decay), **comm)
            lrs = [rates(n) for n in names]
            momenta = cursor.emit_each(aten._foreach_addcmul.Scalar, (before, [grads[i] for i in members], lrs), **comm)
            info = {"kind": "demo", "bucket": index, "grads": tuple(names)}
            buffers = dict(zip(names, momenta))
            means, kept = exchange(program, cursor, buffers, sparsity, basis, info, inline=self.inline_exchange)
            left |= kept
            steps = [means[n] for n in names]
            if self.sign:
                steps = cursor.emit_each(aten._foreach_sign.default, (steps,), **comm)
            for i, name, step in zip(members, names, steps):
                replace_gradient(grads[i], step)
                if self.weight_decay:
                    self._decay(program, cursor, name, rates(name))
        add_outputs(program, list(left.values()), [Port("extra", DEMO_MOMENTUM + n) for n in left])

    def _decay(self, program: StepProgram, cursor: Cursor, name: str, lr: fx.Node) -> None:
        """The update reads ``θ·(1 − lr·λ)`` where it read θ: the authors' ``p.mul_(1 − lr·weight_decay)`` before
        SGD's step, with ``1 − lr·λ`` formed in float64 as Python forms it."""
        param = input_node(program, Port("param", name))
        shrink = cursor.emit(aten.mul.Tensor, (lr, -self.weight_decay), role="optimizer")
        factor = cursor.emit(aten.add.Tensor, (shrink, 1.0), role="optimizer")
        decayed = cursor.emit(aten.mul.Tensor, (param, factor), role="optimizer")
        param.replace_all_uses_with(
            decayed, delete_user_cb=lambda u: u.meta.get("role") == "optimizer" and u is not decayed
        )


def _learning_rates(program: StepProgram) -> Callable[[str], fx.Node]:
    """``lr`` of a parameter's group, a 0-d float64 node (minus the SGD step's ``neg_lr`` input, made once per
    group). Refuses an optimizer that is not SGD without momentum, whose lr DeMo could not take into its momentum."""
    slots: dict[str, dict[str, fx.Node]] = {}
    for node in program.graph.nodes:
        if is_input(node, PortKind.SCALAR):
            group, _, slot = node.meta["port"].name.partition("_")
            slots.setdefault(group, {})[slot] = node
    made: dict[str, fx.Node] = {}

    def rate(name: str) -> fx.Node:
        group = f"g{program.param_groups.get(name)}"
        found = slots.get(group, {})
        if set(found) != {"neg_lr"} or not isinstance(found["neg_lr"].meta.get("val"), torch.Tensor):
            raise ConfigurationError(
                "DeMo takes the optimizer's lr into its momentum (δ = β·δ + lr·g) and steps with SGD on the sign of "
                "the exchanged mean, as its authors' DeMo(torch.optim.SGD) does: give torch.optim.SGD(params, "
                "lr=...) without momentum (weight_decay is allowed)."
            )
        if group not in made:
            made[group] = Cursor(program.graph, found["neg_lr"]).emit(
                aten.neg.default, (found["neg_lr"],), role="communication"
            )
        return made[group]

    return rate
