"""In-process snapshots of a step: ``step.state_dict()`` and ``step.load_state_dict()``.

A snapshot is a deep copy of the model, the optimizers and the transpiler's state (pass-added ``extra`` state,
the schedule's counters, and the setup it was taken in), read back exactly, on the same rank, by a step of the
same kind (``checkpoint_kind.py``). Every rank keeps what it loads: per-rank state such as BatchNorm statistics
and LocalSGD's drift between syncs comes back as saved, and no startup broadcast runs afterwards. On a pipeline
a snapshot is the rank's stage's: its parameters and buffers, and their optimizer state.
"""

from __future__ import annotations

import copy

import torch

from transpiler.errors import CheckpointError

from .checkpoint_kind import CHECKPOINT_FORMAT, CheckpointKind
from .feed import init_extra
from .global_weights import land_in_flight
from .lending import held_whole
from .sharded_params import LentParameters
from .step_state import StepState


def state_dict(state: StepState, lent: LentParameters) -> dict:
    """A deep copy, because ``optimizer.state_dict()`` shares its per-parameter dicts with the live optimizer,
    which every step updates. Under ``zero3`` it holds this rank's slices of the parameters, as
    :func:`load_state_dict` reads them, from the build on (before the first step too: a group under a quorum
    serves its state to a healing peer then)."""
    if not state.lent:  # inside step.gathered() the model is whole, and its snapshot too
        held_whole(state, lent, saving=True)
    outer = state.outer_optimizer
    entries = {"outer_optimizer": outer.state_dict()} if outer is not None else {}
    land_in_flight(state.extra)
    model, optimizer = _held_only(state, state.model.state_dict(), state.optimizer.state_dict())
    return copy.deepcopy(
        {
            "model": model,
            "optimizer": optimizer,
            **entries,
            "transpiler": {
                "format": CHECKPOINT_FORMAT,
                "setup": CheckpointKind.of(state).setup(),
                "extra": state.extra,
                "schedule": state.schedule.state_dict(),
            },
        }
    )


def load_state_dict(state: StepState, lent: LentParameters, snapshot: dict) -> None:
    """Restore a :func:`state_dict` exactly, after checking that it fits this step."""
    if not isinstance(snapshot, dict) or not {"model", "optimizer", "transpiler"} <= set(snapshot):
        raise CheckpointError(
            "a checkpoint for step.load_state_dict() has 'model', 'optimizer' and 'transpiler' entries, as "
            "step.state_dict() returns it. For a plain model checkpoint use model.load_state_dict()."
        )
    saved = snapshot["transpiler"]
    if state.built is None and state.holds_param_slices:
        raise CheckpointError(
            "under zero3 a step.state_dict() holds this rank's slices of the parameters, and the step learns "
            "which slices are its own when it is built: pass example_inputs= to transpile() (or call "
            "step.prepare(batch)) before step.load_state_dict(). step.load_checkpoint() needs neither."
        )
    held_whole(state, lent, saving=False)  # zero3: the model holds its slices, as the checkpoint does
    _check_fits(state, snapshot)
    state.model.load_state_dict(snapshot["model"], strict=state.stage() is None)  # a stage's: checked above
    state.optimizer.load_state_dict(snapshot["optimizer"])
    if state.outer_optimizer is not None:
        state.outer_optimizer.load_state_dict(snapshot["outer_optimizer"])
    state.schedule.load_state_dict(saved.get("schedule", {}))
    state.extra = {k: v.clone() for k, v in saved.get("extra", {}).items()}
    if state.built is not None:
        init_extra(state, state.built)  # an unknown entry fails now, not at the next step
    state.started = True


def _held_only(state: StepState, model: dict, optimizer: dict) -> tuple[dict, dict]:
    """On a pipeline stage, the model's entries and the optimizer's state of this stage's parameters and buffers:
    the values it holds (a stage's snapshot); elsewhere all of them."""
    stage = state.stage()
    if stage is None:
        return model, optimizer
    entries = stage[1]
    mine = {id(p) for name, p in state.last().params.items() if name in entries}
    order = [p for group in state.optimizer.param_groups for p in group["params"]]  # optimizer.state_dict()'s
    positions = {i for i, p in enumerate(order) if id(p) in mine}
    if optimizer:
        optimizer = optimizer | {"state": {i: s for i, s in optimizer["state"].items() if i in positions}}
    return {k: v for k, v in model.items() if k in entries}, optimizer


def _check_fits(state: StepState, snapshot: dict) -> None:
    """The snapshot's kind, model entries and shapes, and param group sizes are this step's."""
    saved, model_state = snapshot["transpiler"], snapshot["model"]
    problems = CheckpointKind.of(state).check(saved.get("format"), saved.get("setup", {}), resharding=False)
    own, _ = _held_only(state, state.model.state_dict(), {})
    missing, unexpected = sorted(set(own) - set(model_state)), sorted(set(model_state) - set(own))
    if missing or unexpected:
        problems.append(f"model entries missing {missing[:4]}, unexpected {unexpected[:4]}")
    shapes = [
        f"{n} {list(model_state[n].shape)} vs {list(t.shape)}"
        for n, t in own.items()
        if n in model_state and torch.is_tensor(t) and tuple(model_state[n].shape) != tuple(t.shape)
    ]
    if shapes:
        problems.append("model shapes differ (checkpoint vs this model): " + ", ".join(shapes[:4]))
    if state.outer_optimizer is not None and "outer_optimizer" not in snapshot:
        problems.append("it holds no outer optimizer state ('outer_optimizer'), which this DiLoCo step keeps")
    groups = snapshot["optimizer"].get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in state.optimizer.param_groups]:
        problems.append("the optimizer's param groups hold other numbers of parameters")
    if problems:
        hint = (
            " To resume at another world size or in another mode on purpose, load the 'model' and 'optimizer' "
            "entries directly (model.load_state_dict, optimizer.load_state_dict)."
        )
        raise CheckpointError("the checkpoint does not fit this step:\n  - " + "\n  - ".join(problems) + hint)
