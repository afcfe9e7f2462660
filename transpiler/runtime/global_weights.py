"""DiLoCo's global weights θ_global: what the step keeps of them (``extra`` state ``global.<param>``), and the
model lent them for a block (``step.global_weights()``), which is what the paper evaluates."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import WAIT
from transpiler.graph.ports import GLOBAL, IN_FLIGHT

from .step_state import StepState, parameter_names


def global_parameters(state: StepState) -> dict[str, torch.Tensor]:
    """θ_global by parameter name, as the last sync left it (before the first, the parameters themselves); the
    tensors the step holds, not copies. An exchange still in flight is waited for first."""
    if state.outer_optimizer is None:
        raise ConfigurationError(
            f"mode {state.mode_specs} keeps no global weights apart from the model's parameters; only "
            "'diloco' and 'streaming_diloco' do."
        )
    land_in_flight(state.extra)  # the run may end with an exchange in flight: nothing is left unwaited
    names = parameter_names(state.model)
    held = {name.removeprefix(GLOBAL): t for name, t in state.extra.items() if name.startswith(GLOBAL)}
    params = state.model.named_parameters()
    return {n: held.get(n, p.detach()) for n, p in params if names[id(p)] == n and p.requires_grad}


@contextlib.contextmanager
def global_weights(state: StepState) -> Iterator[torch.nn.Module]:
    """The model holding θ_global inside the block; each replica's own weights come back on leaving, and an edit
    made inside is not kept. No communication: every rank holds θ_global."""
    state.refuse_while_lent("step.global_weights()")
    global_ = global_parameters(state)
    params = dict(state.model.named_parameters())
    before = {n: params[n].data for n in global_}
    state.lent = True
    try:
        with torch.no_grad():
            for n, t in global_.items():
                params[n].data = t.to(params[n].device, copy=True)  # offloaded: from host memory
        yield state.model
    finally:
        state.lent = False
        for n, data in before.items():
            params[n].data = data


def land_in_flight(extra: dict[str, torch.Tensor]) -> None:
    """Wait for the collectives a program left in flight for a later one (``inflight.*``, Streaming DiLoCo's
    exchange): a checkpoint then holds their results, and the later program's wait finds nothing to wait for."""
    for name in [k for k in extra if k.startswith(IN_FLIGHT)]:
        extra[name] = WAIT(extra[name])
