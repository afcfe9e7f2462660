"""What a training step is traced on: the model's tensors in the graph's order, the optimizer's plan and state,
each as tracing sees it (a parameter ZeRO-3 holds as a slice at its whole shape), and the batch. The trace's
signature (``signature.py``) is computed from these before tracing, so a step that reuses a trace traces nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError

from .optimizers import OptimizerPlan, make_plan

LossFn = Callable[..., torch.Tensor] | None


@dataclass
class ModelState:
    """The model's tensors in the order the graph takes them."""

    names: list[str]  # trainable parameter names (tied parameters once)
    params: list[torch.nn.Parameter]
    frozen_names: list[str]
    frozen: list[torch.nn.Parameter]
    buffer_names: list[str]
    buffers: list[torch.Tensor]


def collect_model_state(model: torch.nn.Module) -> ModelState:
    named = list(model.named_parameters())  # tied parameters appear once
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ConfigurationError(
            "the model has no trainable parameters (every parameter has requires_grad=False); "
            "there is nothing to train or reduce."
        )
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    buffers = list(model.named_buffers())
    return ModelState(
        [n for n, _ in trainable],
        [p for _, p in trainable],
        [n for n, _ in frozen],
        [p for _, p in frozen],
        [n for n, _ in buffers],
        [b for _, b in buffers],
    )


def check_batch(batch: tuple, *, loss_fn: LossFn) -> None:
    if not isinstance(batch, (tuple, list)) or not batch:
        raise ConfigurationError("example_inputs must be a non-empty tuple of tensors, e.g. (x, y).")
    if loss_fn is not None and len(batch) < 2:
        raise ConfigurationError(
            "with a loss_fn the batch is (*model_inputs, target): give at least two tensors, "
            "or pass loss_fn=None if the model returns its own loss."
        )
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise ConfigurationError(
                f"batch element {i} is a {type(t).__name__}; every batch element must be a tensor."
            )


@dataclass
class StepInputs:
    """A step's model state, optimizer plan, and what tracing takes for the parameters and the optimizer state."""

    state: ModelState
    plan: OptimizerPlan
    params: list[torch.Tensor]  # each trainable parameter as traced (its whole shape where a rank holds a slice)
    opt_states: list[list[torch.Tensor]]  # each one's optimizer state as traced


def step_inputs(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: tuple,
    shards: Mapping[str, tuple[int, int]] | None = None,
    whole_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> StepInputs:
    """What one step is traced on (``trace_step`` in ``tracer.py`` says what ``shards`` and ``whole_shapes``
    are)."""
    check_batch(batch, loss_fn=loss_fn)
    state = collect_model_state(model)
    plan = make_plan(optimizer, state.params, state.names)
    params = [_param_as_whole(p, (whole_shapes or {}).get(name)) for name, p in zip(state.names, state.params)]
    opt_states = [
        [t if shards is None else _traced_as_whole(t, p, shards.get(name)) for t in plan.state_tensors(i)]
        for i, (name, p) in enumerate(zip(state.names, params))
    ]
    return StepInputs(state, plan, params, opt_states)


def _param_as_whole(p: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    """A parameter held as a 1-D slice (ZeRO-3, ``shape`` its whole shape) as an uninitialised tensor of its
    whole shape: tracing reads only shapes. Others as they are."""
    if shape is None or tuple(p.shape) == tuple(shape):
        return p
    return torch.empty(shape, dtype=p.dtype, device=p.device)


def _traced_as_whole(t: torch.Tensor, param: torch.Tensor, bounds: tuple[int, int] | None) -> torch.Tensor:
    """A state tensor held as a slice of ``param`` (1-D, ``hi - lo`` elements; before the slices are known, as
    a loaded checkpoint holds them, any 1-D tensor no larger than the parameter) is traced as an
    uninitialised tensor shaped as the parameter: its values never matter to tracing. Other state as it is."""
    if t.shape == param.shape or t.dim() != 1:
        return t
    if t.numel() != (bounds[1] - bounds[0] if bounds is not None else min(t.numel(), param.numel())):
        return t
    return torch.empty_like(param, dtype=t.dtype)
