"""What tracing a step needs from torch's global state, and puts back afterwards.

* Grad mode on and inference mode off: the step computes its own gradients,
  so it traces (and runs) the same whether or not the caller is inside
  ``torch.no_grad()`` or ``torch.inference_mode()``.
* The CPU generator's state as graph ops. ``torch.utils.checkpoint`` saves
  the RNG state before a checkpointed block and restores it before the
  recomputation, so dropout draws the same masks twice. Those calls are not
  tensor ops, so a trace would drop them and the recomputation would draw new
  masks. While tracing, ``torch.get_rng_state``/``torch.set_rng_state`` are
  routed to the ops below, which land in the graph and run every step.
* Reentrant checkpointing (``use_reentrant=True``) runs its own backward with
  ``torch.autograd.backward``, which one traced ``autograd.grad`` cannot
  contain: it is refused with the form that works.
* Autocast, which is a dispatch state at call time. The caller's
  (:class:`AutocastState`, read when the step is called) is part of a
  program's cache key and is applied around the forward and the loss while
  tracing, as eager autocast is meant to wrap them. The graph then holds every
  cast it made, so it runs with autocast off: run inside autocast, its ``mm``
  would be cast again (and ``mm.out`` into a float32 bucket would fail).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as checkpoint_module

from transpiler.errors import UnsupportedModelError

_CPU_GENERATOR = torch.default_generator
AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """The device types autocast is on for, each with its dtype (empty: autocast off everywhere)."""

    enabled: tuple[tuple[str, torch.dtype], ...] = ()

    @classmethod
    def current(cls) -> AutocastState:
        """The caller's autocast state."""
        return cls(tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Autocast as it was for the caller (what the forward and the loss are traced under)."""
        with contextlib.ExitStack() as stack:
            for device, dtype in self.enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield

    def __str__(self) -> str:
        return ", ".join(f"{d} {str(t).removeprefix('torch.')}" for d, t in self.enabled) or "off"


AUTOCAST_OFF = AutocastState()


@torch.library.custom_op("transpiler::rng_get_state", mutates_args=())
def rng_get_state() -> torch.Tensor:
    """The CPU generator's state, as ``torch.get_rng_state()`` returns it."""
    return _CPU_GENERATOR.get_state()


@rng_get_state.register_fake
def _rng_get_state_fake() -> torch.Tensor:
    return torch.empty(_CPU_GENERATOR.get_state().numel(), dtype=torch.uint8)


@torch.library.custom_op("transpiler::rng_set_state", mutates_args=())
def rng_set_state(state: torch.Tensor) -> None:
    """Set the CPU generator's state (a side effect: never removed as dead code)."""
    _CPU_GENERATOR.set_state(state)


@rng_set_state.register_fake
def _rng_set_state_fake(state: torch.Tensor) -> None:
    return None


RNG_SET_STATE = torch.fx.node.has_side_effect(torch.ops.transpiler.rng_set_state.default)
RNG_OPS = frozenset({torch.ops.transpiler.rng_get_state.default, RNG_SET_STATE})


def _refuse_reentrant(*args, **kwargs):
    raise UnsupportedModelError(
        "torch.utils.checkpoint(..., use_reentrant=True) runs its own backward pass, which cannot be traced into "
        "one step graph. Use torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False): it is traced, and "
        "dropout in the checkpointed block draws the same masks in the recomputation as in the forward."
    )


@contextlib.contextmanager
def running_environment() -> Iterator[None]:
    """Grad mode on, inference mode off, autocast off, as the graph was traced.

    Some backward kernels (CPU LSTM) need what forward saves with grad mode on;
    no input of the graph requires grad, so autograd records nothing. Off
    inference mode, the state the step creates is ordinary tensors. The graph
    holds autocast's casts already (see :class:`AutocastState`).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device in AUTOCAST_DEVICES:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def tracing_environment() -> Iterator[None]:
    """Grad mode on, RNG state calls traced, reentrant checkpointing refused; all restored on exit."""
    saved = torch.get_rng_state, torch.set_rng_state
    own_apply = vars(checkpoint_module.CheckpointFunction).get("apply")
    torch.get_rng_state = lambda: torch.ops.transpiler.rng_get_state()
    torch.set_rng_state = lambda state: torch.ops.transpiler.rng_set_state(state)
    checkpoint_module.CheckpointFunction.apply = _refuse_reentrant
    try:
        with running_environment():
            yield
    finally:
        torch.get_rng_state, torch.set_rng_state = saved
        if own_apply is None:
            del checkpoint_module.CheckpointFunction.apply  # the inherited autograd.Function.apply again
        else:
            checkpoint_module.CheckpointFunction.apply = own_apply
