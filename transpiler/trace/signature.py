"""What a traced step graph depends on besides the code it ran: a signature that holds a trace made on one model
and optimizer to another one it is reused for (``transpile(trace=...)``).

A graph bakes in the model's structure, each module's plain attributes (a dropout's ``p``, a norm's ``eps``, a
head count), the shapes, dtypes and devices of every tensor it takes, the optimizer's class and the
hyper-parameters it does not take as per-step scalars (momentum, betas, weight decay; the learning rate is an
input), the loss function, and the caller's autocast state. Two steps with equal signatures trace to the same
graph, provided the forward's code reads nothing else (a global, a file): that part is the caller's promise.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from transpiler.graph.program import StepProgram

from .environment import AutocastState
from .optimizers import OptimizerPlan

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, enum.Enum)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch._ops.OpOverload)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")  # what a trace runs


@dataclass(frozen=True)
class StepSignature:
    """What a trace assumes, as ``(what, value as text)`` items in a fixed order, so a difference can be named."""

    items: tuple[tuple[str, str], ...]
    # what items name by identity (a lambda, the loss function): held, so no other object takes its address
    held: tuple = field(default=(), compare=False, repr=False)

    def first_difference(self, other: StepSignature) -> str | None:
        """The first item that differs, as '<what>: <here> here, <there> in the trace' (None when equal)."""
        if self == other:
            return None
        mine, theirs = dict(self.items), dict(other.items)
        for what in [w for w, _ in other.items] + [w for w, _ in self.items if w not in theirs]:
            now, then = mine.get(what, "absent"), theirs.get(what, "absent")
            if now != then:
                return f"{what}: {_shown(now)} here, {_shown(then)} in the trace"
        return "the same items in another order"


@dataclass(frozen=True)
class StepTrace:
    """One traced training step (forward, loss, backward, update), before any pass: what
    ``transpiler.trace_training_step`` returns and ``transpile(trace=...)`` takes, so that several modes, ranks
    or model instances of the same structure share one trace. ``program`` is never rewritten in place: each use
    copies it. ``learnt`` is what tracing taught the optimizer's plan (the generic path's form and state keys),
    handed to the plan of each step that reuses the trace."""

    program: StepProgram
    signature: StepSignature
    learnt: dict

    def __repr__(self) -> str:
        nodes = len(self.program.graph.nodes)
        optimizer = dict(self.signature.items)["optimizer"]
        return f"StepTrace({nodes} nodes, {len(self.program.inputs)} inputs, {optimizer})"


def step_signature(
    model: torch.nn.Module,
    plan: OptimizerPlan,
    loss_fn: object,
    traced_params: list[torch.Tensor],
    traced_state: list[list[torch.Tensor]],
    batch: tuple,
    autocast: AutocastState,
) -> StepSignature:
    """The signature of one step, given what it is traced on: ``traced_params`` (each trainable parameter as it
    is traced: its whole shape where a rank holds a slice) and ``traced_state`` (each one's optimizer state)."""
    items = list(_items(model, plan, loss_fn, traced_params, traced_state, batch, autocast))
    held = tuple(same.obj for _, value in items for same in _identities(value))
    return StepSignature(tuple((what, value if isinstance(value, str) else repr(value)) for what, value in items), held)


@dataclass(frozen=True)
class _Same:
    """An object a signature compares by identity (its code may close over anything)."""

    obj: object
    name: str

    def __repr__(self) -> str:
        return f"{self.name} at {id(self.obj):#x}"


def _identities(value: object) -> Iterator[_Same]:
    if isinstance(value, _Same):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _identities(item)


def _items(model, plan, loss_fn, traced_params, traced_state, batch, autocast) -> Iterator[tuple[str, object]]:
    for name, module in model.named_modules():
        where = f"module '{name or '<root>'}'"
        yield where, f"{_class(module)}, {'training' if module.training else 'eval'}"
        yield from ((f"{where}.{key}", value) for key, value in _attributes(module))
        hooks = [_plain(hook) for kind in _HOOKS for hook in getattr(module, kind).values()]
        if hooks:
            yield f"{where} hooks", tuple(hooks)
    for name, p in zip(plan.names, traced_params):
        yield f"parameter '{name}'", (*_tensor(p), "trainable" if p.requires_grad else "frozen")
    for name, p in model.named_parameters():
        if not p.requires_grad:
            yield f"frozen parameter '{name}'", _tensor(p)
    for name, b in model.named_buffers():
        yield f"buffer '{name}'", _tensor(b)
    optimizer = plan.optimizer
    yield "optimizer", " + ".join(map(_class, getattr(optimizer, "members", None) or [optimizer]))
    skip = ("param_groups", "state", "defaults", "members")
    yield from ((f"optimizer.{key}", value) for key, value in _attributes(optimizer, skip))
    for group in plan.groups:
        where = f"param group {group.index}"
        yield f"{where} parameters", tuple(plan.names[i] for i in group.param_positions)
        yield f"{where} per-step scalars", tuple(group.slots)
        yield from ((f"{where} {key}", _plain(value)) for key, value in group.frozen_hparams)
    for i, (name, tensors) in enumerate(zip(plan.names, traced_state)):
        yield f"optimizer state of '{name}'", tuple(zip(plan.state_keys(i), map(_tensor, tensors)))
    yield "loss_fn", _loss(loss_fn)
    for i, t in enumerate(batch):
        yield f"batch element {i}", _tensor(t)
    yield "autocast", str(autocast)


def _class(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _tensor(t: torch.Tensor) -> tuple:
    return tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type


def _loss(loss_fn: object) -> object:
    """A loss module by its class and attributes; any other callable by identity (its code may close over
    anything), so a reused trace needs the same function object."""
    if loss_fn is None or isinstance(loss_fn, torch.nn.Module):
        return loss_fn if loss_fn is None else (_class(loss_fn), _attributes(loss_fn))
    return _Same(loss_fn, f"the function {getattr(loss_fn, '__qualname__', _class(loss_fn))}")


def _attributes(obj: object, skip: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """An object's public attributes that a trace may have baked in (``_plain``)."""
    return [
        (key, _plain(value))
        for key, value in sorted(vars(obj).items())
        if not key.startswith("_") and key != "training" and key not in skip
    ]


def _plain(value: object) -> object:
    """A value as a trace may have baked it in: plain values as they are, tensors that are neither parameters nor
    buffers (traced as constants) by a digest of their values, functions by name (one with a closure, or a
    lambda, by identity too: what it closes over is not seen), other objects by class."""
    if isinstance(value, _FUNCTIONS):
        name = f"{getattr(value, '__module__', None) or 'builtins'}.{getattr(value, '__qualname__', repr(value))}"
        closed = getattr(value, "__closure__", None) or "<lambda>" in name
        return _Same(value, name) if closed else name
    if isinstance(value, functools.partial):
        return ("partial", _plain(value.func), _plain(value.args), _plain(value.keywords))
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list, frozenset, set)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return tuple(_plain(v) for v in items)
    if isinstance(value, dict):
        return tuple((repr(k), _plain(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
    if isinstance(value, torch.Tensor):
        return (*_tensor(value), _digest(value))
    return _class(value)


def _digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def _shown(text: str) -> str:
    return text if len(text) <= 160 else text[:157] + "..."
