"""What a mode checks at ``transpile()``, before anything is traced: the optimizers it is given, and the files it
reads. Each check is a small record that raises a ConfigurationError saying what does not fit and what to use
instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.pipeline import Pass
from transpiler.trace.optimizers import TWINS

# optimizers whose update needs whole tensors, which a sharded mode refuses at transpile() (their names, since
# not every torch has them); a user's own optimizer is checked op by op when the step is built
WHOLE_TENSOR = {
    "Adafactor": "its factored second moment averages every row and column of a matrix",
    "Muon": "it orthogonalises every whole matrix (Newton-Schulz iterations)",
}


@dataclass(frozen=True)
class Elementwise:
    """A sharded mode updates each rank's slice of every parameter: the update must be element-wise."""

    mode: str

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        members = getattr(optimizer, "members", [optimizer])  # a chain of optimizers: each of them
        whole = [type(m).__name__ for m in members if type(m).__name__ in WHOLE_TENSOR]
        if whole:
            raise ConfigurationError(
                f"mode '{self.mode}' updates each rank's slice of every parameter, so the optimizer must be "
                f"element-wise; {whole[0]} is not: {WHOLE_TENSOR[whole[0]]}. Use fused_allreduce, or put the "
                "matrices that need it in fused_allreduce and the rest in an element-wise optimizer."
            )


@dataclass(frozen=True)
class PlainSGD:
    """DimReduce's update is Boost's ``SGD(learning_rate=1)``: the user's SGD without momentum or decay."""

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        bad = [
            f"group {i}: {key}={group.get(key)!r}"
            for i, group in enumerate(optimizer.param_groups)
            for key in ("momentum", "weight_decay", "nesterov", "maximize")
            if group.get(key)
        ]
        if type(optimizer) is not torch.optim.SGD or bad:
            got = type(optimizer).__name__ + (f" with {', '.join(bad)}" if bad else "")
            raise ConfigurationError(
                f"mode 'dim_reduce' applies its own update through plain SGD, as MindSpore Boost swaps in "
                f"SGD(learning_rate=1); got {got}. Use torch.optim.SGD(params, lr=1.0) (lr scales every step "
                "DimReduce takes, trials included; momentum and weight decay would act on the line-search trials)."
            )


@dataclass(frozen=True)
class SGDWithoutMomentum:
    """DeMo takes the optimizer's lr into its momentum and steps with SGD on the sign of the exchanged mean, as its
    authors' ``DeMo(torch.optim.SGD)`` does: SGD without momentum (weight decay allowed), or a chain of them. The
    ``demo-exchange`` pass finds the lr in the traced step; this says so before anything is traced."""

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        members = getattr(optimizer, "members", [optimizer])  # a chain of optimizers: each of them
        if not all(isinstance(m, torch.optim.SGD) for m in members) or any(
            g.get("momentum") or g.get("nesterov") for m in members for g in m.param_groups
        ):
            raise ConfigurationError(
                "DeMo takes the optimizer's lr into its momentum (δ = β·δ + lr·g) and steps with SGD on the sign of "
                "the exchanged mean, as its authors' DeMo(torch.optim.SGD) does: give torch.optim.SGD(params, "
                f"lr=...) without momentum (weight_decay is allowed); got {type(optimizer).__name__}."
            )


@dataclass(frozen=True)
class BasisReadable:
    """DimReduce's basis file (its pass reads it when it runs) can be read now, whatever the optimizer."""

    step: Pass  # the dim-reduce pass

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        self.step.rows()


@dataclass(frozen=True)
class OptimizerIn:
    """The optimizer is of one of the classes ``allowed``, or refused with ``why`` (which names it ``{name}``)."""

    allowed: frozenset[type]
    why: str

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer) not in self.allowed:
            raise ConfigurationError(self.why.format(name=type(optimizer).__name__))


# the all-gather mode copies the optimizer's update once per rank's gradient: it needs a functional twin
HAS_TWIN = OptimizerIn(
    frozenset(TWINS),
    "mode 'allgather' applies the optimizer once per rank's gradient, by copying its functional twin; {name} has "
    "none (only torch.optim.SGD, Adam and AdamW do). Use another mode, or one of those optimizers.",
)
# SGD only, where a step count kept per param group would be split: gradient freeze (frozen groups skip steps),
# Streaming DiLoCo's outer optimizer (each fragment steps at its own step)
FREEZE_SGD = OptimizerIn(
    frozenset({torch.optim.SGD}),
    "gradient freeze (freeze_groups) works with torch.optim.SGD; {name} keeps one step count per param group, "
    "which frozen parameters would split. Use SGD, or no freeze.",
)
STREAMING_OUTER_SGD = OptimizerIn(
    frozenset({torch.optim.SGD}),
    "mode 'streaming_diloco' updates one fragment's global weights at a time, so its outer optimizer must keep no "
    "step count per param group; {name} does. Use torch.optim.SGD (the paper's outer optimizer is SGD with "
    "Nesterov momentum), or mode 'diloco'.",
)


@dataclass(frozen=True)
class WholeTensorRefused:
    """Beside a tensor-parallel plan each rank updates its shards of the parameters on their own: the optimizer
    must not need whole tensors (an optimizer of the user's own is checked op by op once traced)."""

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        members = getattr(optimizer, "members", [optimizer])
        whole = [type(m).__name__ for m in members if type(m).__name__ in WHOLE_TENSOR]
        if whole:
            raise ConfigurationError(
                f"{whole[0]} does not run beside a tensor-parallel plan: {WHOLE_TENSOR[whole[0]]}, and each rank "
                "updates its shards of the parameters on their own. Use an element-wise optimizer (SGD, Adam, "
                "AdamW...)."
            )
