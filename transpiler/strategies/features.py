"""The small configs of the features a mode takes as fields: accumulation, loss scaling, clipping, gradient freeze
(which wrap any mode's pipeline: ``composition.py``), gradient compression and sparsification (which change how a
mode reduces). A field left None is the feature off; which mode takes which is its config's fields
(docs/strategies/composition.md)."""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.errors import ConfigurationError

from .config import PassKnobs, knob, own


@dataclass(frozen=True, kw_only=True, repr=False)
class Accumulation(PassKnobs):
    """Gradient accumulation (Boost's, DDP's ``no_sync``): ``steps`` calls make one optimizer update, the first
    ``steps - 1`` accumulating gradients locally, the last reducing once and updating."""

    steps: int = knob(of="accumulate-grads")

    def check(self) -> None:
        if self.steps < 2:
            raise ConfigurationError(
                f"Accumulation(steps={self.steps}) accumulates nothing: give steps >= 2, or accumulation=None."
            )


@dataclass(frozen=True, kw_only=True, repr=False)
class LossScaling(PassKnobs):
    """Loss scaling as ``torch.amp.GradScaler`` does it: the loss gradient times the scale, the gradients times its
    inverse, an overflow on any rank skips the update on every rank; ``dynamic`` grows and backs the scale off by
    GradScaler's rule, else ``init_scale`` stays."""

    dynamic: bool = knob(True, of="loss-scale")
    init_scale: float = knob(2.0**16, of="loss-scale")
    growth_factor: float = knob(2.0, of="loss-scale")
    backoff_factor: float = knob(0.5, of="loss-scale")
    growth_interval: int = knob(2000, of="loss-scale")
    min_scale: float = knob(1.0, of="loss-scale")


@dataclass(frozen=True, kw_only=True, repr=False)
class Clipping(PassKnobs):
    """``clip_grad_norm_`` on the reduced gradients (under ZeRO from each rank's shards, one all-reduce of partial
    norms); the norm is ``step.last_metrics["grad_norm"]``."""

    max_norm: float = knob(of="clip-grad-norm")
    norm_type: float = knob(2.0, of="clip-grad-norm")

    def check(self) -> None:
        if self.max_norm == 0:
            raise ConfigurationError(
                "Clipping(max_norm=0.0) would zero every gradient: give the largest norm the gradients may have, "
                "or clipping=None for no clipping."
            )


@dataclass(frozen=True, kw_only=True, repr=False)
class Freeze(PassKnobs):
    """MindSpore Boost's gradient freeze: the parameters cut into ``groups`` consecutive groups in model order; a
    step trains the groups from an index on (one program per index), chosen by ``type``: 0 a continuous schedule,
    1 at random intervals (``seed``, the same on every rank), training every group on a share ``p`` of steps."""

    groups: int = knob(of="freeze-groups")
    type: int = own(1, minimum=0, maximum=1, help="0: continuous schedule, 1: interval (random)")
    p: float = own(0.7, minimum=0, maximum=0.99, help="share of steps that train every group")
    seed: int = own(0, minimum=0, help="seed of the interval schedule (the same on every rank)")

    def check(self) -> None:
        if self.groups < 2:
            raise ConfigurationError(f"Freeze(groups={self.groups}) freezes nothing: give groups >= 2, or freeze=None.")


@dataclass(frozen=True, kw_only=True, repr=False)
class Compression(PassKnobs):
    """Reduce in half precision (SINGA's fp16 all-reduce, DDP's fp16/bf16 hooks): each bucket divided by the world
    size, cast, all-reduced, cast back."""

    wire_dtype: str = knob("fp16", of="fuse-allreduce", choices=("fp16", "bf16"))


@dataclass(frozen=True, kw_only=True, repr=False)
class Sparsification(PassKnobs):
    """SINGA's top-K sparsification with error feedback: a share ``ratio`` of each bucket's entries of
    ``gradient + residual`` sent by one all-gather (``threshold``: only those with ``|x| >=`` it), the rest kept
    as the residual."""

    ratio: float = knob(of="sparse-allreduce")
    threshold: float = knob(0.0, of="sparse-allreduce")


FEATURES: tuple[type[PassKnobs], ...] = (Accumulation, LossScaling, Clipping, Freeze, Compression, Sparsification)
