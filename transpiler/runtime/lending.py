"""ZeRO-3's parameters lent whole to a block (``step.gathered()``), and held as slices everywhere else.

Under ``zero3`` the model holds this rank's slice of each sharded parameter between steps
(``sharded_params.LentParameters``). Inside ``with step.gathered():`` they are whole, gathered from every rank;
while they are lent, a step, a checkpoint or another lending block is refused (``StepState.lent``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .process_group import require_live
from .sharded_params import LentParameters
from .step_state import StepState


@contextlib.contextmanager
def gathered(state: StepState, lent: LentParameters, writeback: bool) -> Iterator[torch.nn.Module]:
    """``step.gathered()``: under ``zero3`` the model with whole parameters inside the block; in the other modes
    the parameters are whole already and it does nothing. Yields the model."""
    built = state.built
    if built is None or not built.main.param_buckets:
        yield state.model
        return
    require_live(state.placement)
    state.refuse_while_lent("step.gathered()")
    with lent.gathered(built.main, built.params, writeback) as model:
        state.lent = True
        try:
            yield model
        finally:
            state.lent = False


def held_whole(state: StepState, lent: LentParameters) -> dict[str, tuple[int, ...]]:
    """ZeRO-3, once the step is built: the whole shape of each parameter, and the model now holds this rank's
    slices of them (cut here if no step has yet). Empty in other modes."""
    built = state.built
    if built is None or not built.main.param_buckets:
        return {}
    state.refuse_while_lent("a checkpoint")
    lent.hold(built.main, built.params)
    return {name: tuple(shape) for name, shape in built.whole.items()}
