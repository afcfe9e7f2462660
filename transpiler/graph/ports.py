"""What a program's inputs and outputs carry, and the state passes add to it: the kinds of ports, the names of
pass-added state, and how that state starts. One place that passes, verifiers and the runtime all read, so no
layer types another's strings again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class PortKind(str, enum.Enum):
    """What one graph input or output carries. Members equal (and hash as) their strings, so ``port.kind ==
    "param"`` holds and a port prints as it always has."""

    PARAM = "param"  # a trainable parameter (input) or its new value (output)
    FROZEN = "frozen"  # a parameter that takes no gradient
    BUFFER = "buffer"  # a module buffer (BatchNorm statistics)
    STATE = "state"  # an optimizer-state entry, ``<param>.<key>`` (the outer optimizer's under ``outer/``)
    BATCH = "batch"  # one tensor of the batch, ``batch<i>``
    SCALAR = "scalar"  # a per-step scalar slot of an optimizer (``lr``, a bias correction), ``<slot>@j`` ahead
    EXTRA = "extra"  # state a pass added, which the runtime keeps between steps (names below)
    FLAT = "flat"  # a flat buffer of many parameters or state entries (``program.flat_buffers``)
    LOSS = "loss"  # the output: this rank's loss
    METRIC = "metric"  # an output float the schedule or the user reads (``overflow``, ``avg_loss``)
    GRAD = "grad"  # an outer update's input: what it reads as the gradient (DiLoCo's averaged Δ)
    QUORUM = "quorum"  # a value of this step's quorum, read at run time (``participants``: fault tolerance)

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


@dataclass(frozen=True)
class Port:
    """One graph input or output: what it carries and the name it refers to."""

    kind: PortKind
    name: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", PortKind(self.kind))


def is_input(node: torch.fx.Node, kind: PortKind) -> bool:
    """Whether ``node`` is a graph input of port kind ``kind``."""
    port = node.meta.get("port")
    return node.op == "placeholder" and port is not None and port.kind == kind


# The names of pass-added (``extra``) state and of ports a pass prefixes, by the pass that adds them.
OUTER = "outer/"  # the outer optimizer's state and scalar ports (diloco-outer-step)
GLOBAL = "global."  # θ_global, DiLoCo's global weights, ``global.<param>``
IN_FLIGHT = "inflight."  # a collective carried unwaited to a later program (Streaming DiLoCo's exchange)
ACCUMULATOR = "accum."  # gradient accumulators, zero after every update (accumulate-grads)
RESIDUAL = "residual."  # what sparsification has not sent yet (sparse-allreduce)
ERROR_FEEDBACK = "error_feedback."  # SparseLoCo's error buffer, never sent (diloco-outer-step with topk)
SNAPSHOT = "snapshot."  # the parameters at the last sync (local-sgd-average)
LOSS_SCALE = "loss_scale.scale"  # the dynamic loss scale (loss-scale)
GROWTH_TRACKER = "loss_scale.growth_tracker"  # clean steps since the scale last changed (loss-scale)
DIM_REDUCE = "dim_reduce."  # DimReduce's subspace state (dim-reduce)
RESIDUAL_MOMENTUM = "residual_momentum."  # DimReduce's momentum outside the subspace (dim-reduce)
PARTICIPANTS = "participants"  # the ranks a step's mean runs over, under a torchft quorum (scale-loss-grad)
DEMO_MOMENTUM = "demo_momentum."  # DeMo's momentum, never sent (demo-exchange)
# extra state that never leaves its rank but as a compressor's message (verify.py)
PRIVATE = (ERROR_FEEDBACK, DEMO_MOMENTUM)
REPLICATED = (LOSS_SCALE, GROWTH_TRACKER)  # extra state the same on every rank: a DCP checkpoint saves it once


def dtype_name(dtype: str | torch.dtype) -> str:
    """A dtype as plans and rules write it: ``"float32"``, not ``torch.float32``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


class InitRule(str, enum.Enum):
    """How the runtime makes a pass-added state tensor before its first step."""

    COPY_PARAM = "copy_param"  # a copy of the parameter (LocalSGD's snapshot, θ_global)
    HOST_COPY_PARAM = "host_copy_param"  # the same in host memory (θ_global offloaded)
    ZEROS_LIKE_PARAM = "zeros_like_param"  # zeros shaped as the parameter (accumulators, residuals)
    SCALAR = "scalar"  # a 0-d tensor of a value (the loss scale)
    ZEROS = "zeros"  # zeros of a shape (sharded accumulators, an exchange's wire buffer)
    EYE = "eye"  # the float32 identity (DimReduce's curvature)

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


@dataclass(frozen=True)
class ExtraInit:
    """The rule a pass declares for one ``extra`` input (``program.extra_init``); new tensors go where the
    parameters are, but for ``HOST_COPY_PARAM``."""

    rule: InitRule
    param: str = ""  # the parameter copied or imitated
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    value: float = 0.0

    @classmethod
    def copy_of(cls, param: str) -> ExtraInit:
        return cls(InitRule.COPY_PARAM, param)

    @classmethod
    def host_copy_of(cls, param: str) -> ExtraInit:
        return cls(InitRule.HOST_COPY_PARAM, param)

    @classmethod
    def zeros_like(cls, param: str) -> ExtraInit:
        return cls(InitRule.ZEROS_LIKE_PARAM, param)

    @classmethod
    def scalar(cls, value: float, dtype: str | torch.dtype) -> ExtraInit:
        return cls(InitRule.SCALAR, value=value, dtype=dtype_name(dtype))

    @classmethod
    def zeros(cls, shape: tuple[int, ...] | list[int], dtype: str | torch.dtype = "float32") -> ExtraInit:
        return cls(InitRule.ZEROS, shape=tuple(shape), dtype=dtype_name(dtype))

    @classmethod
    def eye(cls, size: int) -> ExtraInit:
        return cls(InitRule.EYE, shape=(size,))

    @property
    def on_host(self) -> bool:
        """Whether the tensor lives in host memory whatever the parameters' device."""
        return self.rule is InitRule.HOST_COPY_PARAM

    def make(self, params: dict[str, torch.nn.Parameter]) -> torch.Tensor:
        """The first value, from the model's parameters by name."""
        if self.rule is InitRule.COPY_PARAM:
            return params[self.param].detach().clone()
        if self.rule is InitRule.HOST_COPY_PARAM:
            return params[self.param].detach().to("cpu", copy=True)
        if self.rule is InitRule.ZEROS_LIKE_PARAM:
            return torch.zeros_like(params[self.param].detach())
        device = next(iter(params.values())).device
        if self.rule is InitRule.SCALAR:
            return torch.tensor(float(self.value), dtype=getattr(torch, self.dtype), device=device)
        if self.rule is InitRule.ZEROS:
            return torch.zeros(list(self.shape), dtype=getattr(torch, self.dtype), device=device)
        return torch.eye(self.shape[0], dtype=torch.float32, device=device)
