"""``demo-exchange``: DeMo, decoupled momentum optimisation (Peng et al., 2024), as a gradient reduction.

Requires: gradient nodes tagged ``grad_of`` (not yet reduced), each rank's own (no ``scale-loss-grad``: the pass
takes the mean itself).
Guarantees: each rank adds its gradient into a momentum that is never sent, ``m = β·m + g``
(``demo_momentum.<param>``, extra state starting at zero). In dtype/size buckets, each momentum is flattened and
padded with zeros to whole chunks of ``chunk`` elements; each chunk's coefficients in the orthonormal DCT-II
basis ``D`` (``c = x Dᵀ``, :func:`dct_matrix`, a constant of the program) go through the sparse exchange of
``sparse_pseudo_exchange``: the ``topk`` coefficients of largest magnitude per chunk, in ``value_bits``, one
all-gather per bucket. What was sent leaves the momentum, ``m ← m − ĉ D``, and every rank decodes every rank's
coefficients, adds them in rank order, returns them to values (``(Σ ĉ) D``) and multiplies by ``1/W``. The
optimizer reads that mean, or with ``sign`` its sign (DeMo's update), as the gradient. The momentum itself never
leaves the rank: the verifier ``check_private_state_stays`` holds the pass to that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.edit import Cursor
from transpiler.graph.options import option
from transpiler.graph.ports import DEMO_MOMENTUM, ExtraInit, Port
from transpiler.graph.program import StepProgram

from .bucketing import BucketedGradientPass
from .gradient_flow import add_constant, add_outputs, add_state, replace_gradient
from .sparse_pseudo_exchange import check_options, exchange

aten = torch.ops.aten


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n`` in float32: ``D[k, i] = sqrt(w_k / n) · cos(π (2i + 1) k / 2n)``,
    ``w_0 = 1`` and ``w_k = 2``, computed in float64 (``D Dᵀ = I``; the coefficients of a row ``x`` are ``x Dᵀ``)."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    weight = torch.full((n, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    return (torch.sqrt(weight / n) * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))).to(torch.float32)


@dataclass(frozen=True)
class DeMoExchange(BucketedGradientPass):
    name = "demo-exchange"
    summary = "DeMo: local momentum, its top-k DCT coefficients per chunk all-gathered, the decoded mean's sign"
    decay: float = option(0.999, minimum=0, maximum=1, help="β of the local momentum m = β·m + g")
    chunk: int = option(64, minimum=2, help="elements per chunk the DCT and the top-k work on")
    topk: int = option(4, minimum=1, help="DCT coefficients sent per chunk")
    value_bits: int = option(32, minimum=2, maximum=32, help="bits per sent coefficient (2, 4, 8 or 32)")
    sign: bool = option(True, help="the optimizer steps on the sign of the decoded mean (DeMo); off: the mean")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_options(self.topk, self.chunk, self.value_bits, "DeMo")

    def reduce(self, program: StepProgram, grads: list[fx.Node]) -> None:
        bad = [g.meta["grad_of"] for g in grads if g.meta["val"].dtype != torch.float32]
        if bad:
            raise ConfigurationError(f"DeMo's momenta are float32; the gradients of {bad[:3]} are not.")
        basis = add_constant(program, f"dct_{self.chunk}", dct_matrix(self.chunk), role="communication")
        momenta = []
        for grad in grads:
            name = grad.meta["grad_of"]
            kept = add_state(program, DEMO_MOMENTUM + name, grad, ExtraInit.zeros_like(name))
            cursor = Cursor(program.graph, grad)
            decayed = cursor.emit(aten.mul.Tensor, (kept, self.decay), role="communication")
            momenta.append(cursor.emit(aten.add.Tensor, (decayed, grad), role="communication"))
        left: dict[str, fx.Node] = {}
        inverse = 1.0 / program.world_size
        for index, members, cursor in self.buckets(program, momenta):
            names = {grads[i].meta["grad_of"]: momenta[i] for i in members}
            info = {"kind": "demo", "bucket": index, "grads": tuple(names)}
            sums, kept = exchange(program, cursor, names, self.topk, self.chunk, self.value_bits, basis, info)
            left |= kept
            for i in members:
                name = grads[i].meta["grad_of"]
                mean = cursor.emit(aten.mul.Tensor, (sums[name], inverse), role="communication")
                step = cursor.emit(aten.sign.default, (mean,), role="communication") if self.sign else mean
                replace_gradient(grads[i], step)
        add_outputs(program, list(left.values()), [Port("extra", DEMO_MOMENTUM + n) for n in left])
