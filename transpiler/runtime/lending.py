"""ZeRO-3's parameters lent whole to a block (``step.gathered()``), and held as slices everywhere else.

Under ``zero3`` the model holds this rank's slice of each sharded parameter between steps
(``sharded_params.LentParameters``). Inside ``with step.gathered():`` they are whole, gathered from every rank;
while they are lent, a step, a checkpoint or another lending block is refused (``StepState.lent``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from transpiler.errors import CheckpointError

from .process_group import require_live
from .sharded_params import LentParameters
from .startup import Startup
from .step_state import StepState


@contextlib.contextmanager
def gathered(state: StepState, lent: LentParameters, writeback: bool, startup: Startup) -> Iterator[torch.nn.Module]:
    """``step.gathered()``: under ``zero3`` the model with whole parameters inside the block; in the other modes
    the parameters are whole already and it does nothing. Yields the model. Before the first step the startup
    runs first (every rank enters the block): it broadcasts rank 0's whole parameters, which it could not do once
    the model holds slices."""
    built = state.built
    if built is None or not built.main.param_buckets:
        yield state.model
        return
    require_live(state.placement)
    state.refuse_while_lent("step.gathered()")
    startup.ready(state, built)
    with lent.gathered(built.main, built.params, writeback) as model:
        state.lent = True
        try:
            yield model
        finally:
            state.lent = False


def held_whole(state: StepState, lent: LentParameters, *, saving: bool) -> dict[str, tuple[int, ...]]:
    """ZeRO-3, once the step is built: the whole shape of each parameter, and the model now holds this rank's
    slices of them (cut here if no step has yet). Empty in other modes. A snapshot before the first step of a
    world of several ranks is refused: the startup, which broadcasts rank 0's whole parameters, has not run, and
    it could not run on slices; ``save_checkpoint`` runs it first, as every rank calls it (a load replaces the
    startup, so it may come first)."""
    built = state.built
    if built is None or not built.main.param_buckets:
        return {}
    state.refuse_while_lent("a checkpoint")
    startup = any(p.startup is not None for p in built.programs.values())
    if saving and startup and not state.started and state.placement.world_size > 1:
        raise CheckpointError(
            "under zero3 a checkpoint holds this rank's slices of the parameters, and before the first step the "
            "model still holds them whole for the startup, which broadcasts rank 0's weights to every rank: "
            "save after a step, or call step.save_checkpoint(path) or enter `with step.gathered():` once first "
            "(every rank; each runs the startup)."
        )
    lent.hold(built.main, built.params)
    return {name: tuple(shape) for name, shape in built.whole.items()}
