"""A program's ports at run time: what feeds each input, and where each output goes.

Inputs are matched by their ports, so a pass can add either: parameters, frozen parameters and buffers from the
model, optimizer state from the optimizer (the outer optimizer's under ``outer/``), the batch, the optimizers'
per-step scalars, pass-added state from the step's ``extra``, and flat buffers from the flat storage. Outputs go
back the same way: ``.data`` re-bound (after ``reinplace-optimizer`` the same storage, updated in place), state
written into the optimizers, ``extra`` kept, metrics returned as floats.
"""

from __future__ import annotations

import torch

from transpiler.errors import CheckpointError, ConfigurationError
from transpiler.graph.ports import OUTER, PortKind
from transpiler.graph.program import StepProgram

from .program_cache import Built
from .scalar_bank import ScalarBank
from .sharded_params import held_slice
from .step_state import StepState


def inputs(
    state: StepState,
    program: StepProgram,
    built: Built,
    batch: tuple,
    variant: str,
    quorum: dict[str, torch.Tensor] | None = None,
) -> list:
    """The program's inputs, in port order (``quorum``: this step's quorum values, under fault tolerance)."""
    ports = built.ports[variant]
    kinds = ports.kinds  # a flattened program reads no parameter or state one by one
    if PortKind.QUORUM in kinds and not quorum:
        raise ConfigurationError(
            "this program reads the step's participant count ('scale-loss-grad{participants=true}'), which only a "
            "step under transpile(fault_tolerance=...) feeds; without one, use plain 'scale-loss-grad'."
        )
    tensors = {
        PortKind.QUORUM: quorum or {},
        PortKind.BUFFER: built.buffers,
        PortKind.BATCH: {f"batch{i}": t for i, t in enumerate(batch)},
        PortKind.SCALAR: _scalars(ports.scalars, built, variant),
        PortKind.EXTRA: state.extra,
        PortKind.FLAT: state.flat.buffers,
    }
    if PortKind.PARAM in kinds:
        tensors[PortKind.PARAM] = {name: built.params[name].detach() for name in ports.params}
    if PortKind.FROZEN in kinds:
        tensors[PortKind.FROZEN] = {n: p.detach() for n, p in built.frozen.items()}
    if PortKind.STATE in kinds:
        tensors[PortKind.STATE] = _state_inputs(program, built, ports.state)
    return [tensors[kind][name] for kind, name in ports.order]


def _state_inputs(program: StepProgram, built: Built, entries: tuple) -> dict[str, torch.Tensor]:
    """The optimizers' state by port name: the inner optimizer's (:func:`_inner_state`), and the outer one's under
    ``outer/`` where the program reads it."""
    tensors = _inner_state(program, built, entries)
    if built.outer is not None and any(p.kind == PortKind.STATE and p.name.startswith(OUTER) for p in program.inputs):
        for i, name in enumerate(built.state.names):
            for key, t in zip(built.outer.state_keys(i), built.outer.state_tensors(i)):
                tensors[f"{OUTER}{name}.{key}"] = t
    return tensors


def _inner_state(program: StepProgram, built: Built, entries: tuple) -> dict[str, torch.Tensor]:
    """The optimizer state by port name (``entries``: the program's state ports, :class:`ProgramPorts`). Under
    a sharded mode (``program.shards``) a state tensor still shaped as its parameter is cut to this rank's slice,
    and a stored one is replaced by its slice for good (so the whole tensor is freed): ``optimizer.state`` then
    holds 1-D slices, a 0-d ``step`` whole."""
    plan = built.plan
    held = None if program.shards else _held_state(plan.optimizer.state, entries)
    if held is not None:
        return held
    tensors = {}
    for i, (name, param) in enumerate(zip(built.state.names, built.state.params)):
        bounds = program.shards.get(name)
        shape = torch.Size(built.whole.get(name, param.shape))
        for key, t in zip(plan.state_keys(i), plan.state_tensors(i)):
            if bounds is not None and t.dim() > 0:
                t = _own_slice(built, i, key, t, bounds, shape)
            tensors[f"{name}.{key}"] = t
    return tensors


def _held_state(state: dict, entries: tuple) -> dict[str, torch.Tensor] | None:
    """Each state port's tensor as the optimizer holds it, read directly; None where one is not held yet (the
    plan creates it as eager does) or is linked to autograd (the plan feeds it detached)."""
    tensors = {}
    for port, param, key in entries:
        value = state.get(param, _NONE).get(key)
        if not isinstance(value, torch.Tensor) or value.requires_grad:
            return None
        tensors[port] = value
    return tensors


_NONE: dict = {}  # what a parameter without optimizer state holds


def _own_slice(
    built: Built, position: int, key: str, t: torch.Tensor, bounds: tuple[int, int], shape: torch.Size
) -> torch.Tensor:
    """This rank's slice ``bounds`` of a parameter's state tensor, stored in place of the whole tensor (which is
    freed) while it is still shaped as the parameter (``shape``, its whole shape), as it is once cut."""
    lo, hi = bounds
    if t.shape == shape:
        piece = held_slice(t, shape.numel(), bounds)
        if hi - lo == shape.numel():
            return piece
        piece = piece.clone()
        plan = built.plan
        if key in plan.optimizer.state.get(plan.params[position], {}):
            plan.write_back(position, {key: piece})
        return piece
    if t.shape != (hi - lo,):
        raise CheckpointError(
            f"optimizer state '{built.plan.names[position]}.{key}' has shape {list(t.shape)}; this rank holds "
            f"elements [{lo}, {hi}) of that parameter, or the whole tensor. Was it loaded from a checkpoint of "
            "another world size? step.load_state_dict() reads its own world size only; step.load_checkpoint() "
            "reads any."
        )
    return t


def _scalars(names: tuple[str, ...], built: Built, variant: str) -> dict:
    """This step's scalar inputs (ports ``names``), each from its optimizer's plan (``outer/`` ports from the
    outer one's): floats for the generic path, the twins' persistent tensors filled in place."""
    out: dict = {}
    for prefix, plan in (("", built.plan), (OUTER, built.outer)):
        mine = [n for n in names if n.startswith(OUTER) == bool(prefix)]
        if not mine:
            continue
        values = {prefix + k: v for k, v in plan.scalar_inputs([n.removeprefix(prefix) for n in mine]).items()}
        if not plan.scalars_as_tensors:
            out.update(values)
            continue
        bank = built.scalar_banks.get(prefix + variant)
        if bank is None:
            bank = built.scalar_banks[prefix + variant] = ScalarBank(mine, built.device)
        out.update(bank.fill(values))
    return out


def write_back(
    state: StepState, program: StepProgram, built: Built, variant: str, fed: list, outputs: tuple
) -> dict[str, float]:
    """Each output to where its port says; returns the metrics. An output that is the very tensor its port was
    ``fed`` (an update in place) is where it belongs already: a parameter, or a state tensor the optimizer holds,
    is skipped. A step whose loss scaling skipped the update creates no optimizer state, as eager's skipped
    ``optimizer.step()`` does."""
    plan = built.plan
    new_states: dict[int, dict[str, torch.Tensor]] = {}
    metrics: dict[str, float] = {}
    ports = built.ports[variant]
    held_state = plan.optimizer.state
    for port, value, returned, held in zip(program.outputs, outputs, ports.returned, ports.held):
        kind = port.kind
        if returned is not None and value is fed[returned]:
            if held is None or held_state.get(held[0], _NONE).get(held[1]) is value:
                continue
        if kind == PortKind.PARAM:
            built.params[port.name].data = value
        elif kind == PortKind.FROZEN:
            built.frozen[port.name].data = value
        elif kind == PortKind.BUFFER:
            if value is not built.buffers[port.name]:
                built.buffers[port.name].data = value
        elif kind == PortKind.STATE and port.name.startswith(OUTER):
            name, key = port.name.removeprefix(OUTER).rsplit(".", 1)
            built.outer.write_back(built.positions[name], {key: value})
        elif kind == PortKind.STATE:
            name, key = port.name.rsplit(".", 1)
            new_states.setdefault(built.positions[name], {})[key] = value
        elif kind == PortKind.EXTRA:
            state.extra[port.name] = value
        elif kind == PortKind.METRIC:
            metrics[port.name] = float(value)
    skipped = metrics.get("overflow", 0.0) != 0.0  # loss scaling skipped the update
    for position, values in new_states.items():
        if skipped:  # eager's optimizer.step() never ran, so it created no state; neither do we
            held = plan.optimizer.state.get(plan.params[position], {})
            values = {key: value for key, value in values.items() if key in held}
        plan.write_back(position, values)
    state.optimizer._opt_called = True  # what LR schedulers check to see that the optimizer stepped
    if built.outer is not None:
        state.outer_optimizer._opt_called = True
    return metrics


def init_extra(state: StepState, built: Built) -> None:
    """Create pass-added state on first use, by the rule its pass declared (after the startup broadcast); an entry
    no program declares (from a checkpoint of another mode or model) is an error."""
    unknown = state.extra.keys() - built.extra_init.keys()
    if unknown:
        raise CheckpointError(
            f"the loaded checkpoint holds state {sorted(unknown)[:4]} that this step does not declare "
            f"(it declares {sorted(built.extra_init)[:4] or 'none'}): it comes from another mode or model."
        )
    for name, init in built.extra_init.items():
        if name not in state.extra:
            state.extra[name] = init.make(built.params)
        elif init.on_host and state.extra[name].device.type != "cpu":  # loaded onto the device
            state.extra[name] = state.extra[name].cpu()
