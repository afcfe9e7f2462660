"""A step's DCP checkpoints: ``step.save_checkpoint()`` and ``step.load_checkpoint()``, written with
``torch.distributed.checkpoint`` and read back at any world size.

A mode that keeps the ranks in step writes its model and optimizer once, and each rank its slices of what is
sharded (``sharded_checkpoint.py``); a DiLoCo step writes θ_global once and a row per replica
(``replica_checkpoint.py``). Both modules load with their first use, not at start-up: they import
``torch.distributed.checkpoint``, which a step that never checkpoints does not need. What may read what is
``CheckpointKind``'s one check. Every collective runs on the step's group, within its timeout, and a failed one
names the ranks that went silent.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from transpiler.errors import CheckpointError
from transpiler.graph.ports import ACCUMULATOR, GLOBAL, IN_FLIGHT, REPLICATED
from transpiler.trace.tensor_parallel import tensor_parallel_of

from .checkpoint_kind import CheckpointKind
from .failures import failures_named
from .feed import init_extra
from .global_weights import global_parameters
from .lending import held_whole
from .process_group import live_group
from .sharded_params import LentParameters
from .step_state import StepState, parameter_names

if TYPE_CHECKING:
    from .sharded_checkpoint import Ranks

Shards = dict[str, tuple[int, int]]


def _sharded_checkpoint() -> Any:
    """``runtime/sharded_checkpoint.py``, imported when a DCP checkpoint is written or read, not at start-up."""
    from . import sharded_checkpoint

    return sharded_checkpoint


def _replica_checkpoint() -> Any:
    """``runtime/replica_checkpoint.py`` (DiLoCo's checkpoints), imported as :func:`_sharded_checkpoint` is."""
    from . import replica_checkpoint

    return replica_checkpoint


def blocked(state: StepState) -> str | None:
    """Why a checkpoint cannot be saved now (None: it can): in the middle of an accumulation cycle, or with a
    Streaming DiLoCo exchange in flight."""
    if state.schedule.state_dict().get("micro_step", 0):
        return (
            "save_checkpoint() in the middle of an accumulation cycle would drop the gradients accumulated so "
            "far; call it after the cycle's last micro-step (when step.last_variant is not 'accumulate')."
        )
    if state.schedule.in_flight():
        return (
            "save_checkpoint() with a Streaming DiLoCo exchange in flight: its sum belongs to this world (and "
            "under a quantised exchange each rank holds its own part), so no other world could resume it. Call "
            "it after the step that applies it (when step.checkpoint_blocked() is None), as a Checkpointer does."
        )
    return None


def refuse_tensor_parallel(state: StepState) -> None:
    """DCP reads a checkpoint at another world size by the parameters' global shapes; under a tensor-parallel plan
    each rank's step holds its shards as plain tensors, so that is not built."""
    if tensor_parallel_of(state.model) is not None:
        raise CheckpointError(
            "save_checkpoint()/load_checkpoint() are not built beside a tensor-parallel plan: each rank holds its "
            "shards of the parameters as plain tensors, so a checkpoint could not be read at another mesh shape. "
            "Save step.state_dict() on every rank with torch.save, and resume at the same mesh shape."
        )


def save(state: StepState, lent: LentParameters, path: str | Path) -> None:
    """Write the step's state to the folder ``path``; every rank calls it."""
    refuse_tensor_parallel(state)
    why = blocked(state)
    if why is not None:
        raise CheckpointError(why)
    if state.outer_optimizer is not None:
        return _save_replicas(state, path)
    if not state.replicated:
        raise CheckpointError(
            f"mode {state.mode_specs} keeps ranks apart between updates (their parameters or state differ), so "
            "a checkpoint read at another world size has no one answer. Save step.state_dict() on every rank "
            "with torch.save, and resume at the same world size."
        )
    per_rank = sorted(k for k in state.extra if k not in REPLICATED and not k.startswith(ACCUMULATOR))
    if per_rank:
        raise CheckpointError(
            f"this step keeps per-rank state {per_rank[:4]} (sparsification residuals, say), which a checkpoint "
            "read at another world size cannot split. Save step.state_dict() per rank instead."
        )
    sharded_checkpoint = _sharded_checkpoint()
    ranks = _ranks(state)
    with failures_named(f"saving the checkpoint {path}", state.placement):
        shards, whole = _shards(state) or {}, held_whole(state, lent, saving=True)
        names = parameter_names(state.model)
        checkpoint = {
            "model": sharded_checkpoint.model_state(state.model, whole, shards, ranks),
            "optim": sharded_checkpoint.optimizer_state(state.optimizer, names, shards, ranks, whole),
            "transpiler": {
                "extra": {k: v for k, v in state.extra.items() if k.startswith(REPLICATED)},
                "schedule": state.schedule.state_dict(),
                "setup": CheckpointKind.of(state).record(),
            },
        }
        sharded_checkpoint.save(checkpoint, path, ranks)


def _save_replicas(state: StepState, path: str | Path) -> None:
    """DiLoCo's checkpoint: θ_global, the outer state and the schedule once, each replica's weights and inner
    state as its row."""
    own = {k: v for k, v in state.extra.items() if not k.startswith((GLOBAL, IN_FLIGHT, ACCUMULATOR))}
    ranks = _ranks(state)
    with failures_named(f"saving the checkpoint {path}", state.placement):
        _replica_checkpoint().save(
            path,
            model=state.model,
            optimizer=state.optimizer,
            outer=state.outer_optimizer,
            global_params=global_parameters(state),
            extra=own,
            transpiler={"schedule": state.schedule.state_dict(), "setup": CheckpointKind.of(state).record()},
            shards=_shards(state) or {},
            replica=_replica(state),
            ranks=ranks,
        )


def load(state: StepState, lent: LentParameters, path: str | Path) -> None:
    """Read a :func:`save` folder, written at any world size and in any mode of this step's layout; every rank
    calls it. Once the step is built each rank reads only its own slices of what is sharded; before, whole
    tensors, cut at the first step."""
    refuse_tensor_parallel(state)
    with failures_named(f"loading the checkpoint {path}", state.placement):
        saved = _sharded_checkpoint().read_setup(path, _ranks(state))
        CheckpointKind.of(state).check(saved.get("format"), saved, resharding=True, path=path)
        if state.outer_optimizer is not None:
            _load_replicas(state, path)
        else:
            _load_in_step(state, lent, path)
    if state.built is not None:
        init_extra(state, state.built)
    state.started = True


def _load_replicas(state: StepState, path: str | Path) -> None:
    loaded = _replica_checkpoint().load(
        path,
        model=state.model,
        optimizer=state.optimizer,
        outer=state.outer_optimizer,
        shards=_shards(state),
        replica=_replica(state),
        ranks=_ranks(state),
    )
    state.schedule.load_state_dict(loaded.schedule)
    state.extra = {f"{GLOBAL}{name}": t for name, t in loaded.global_params.items()} | loaded.extra


def _load_in_step(state: StepState, lent: LentParameters, path: str | Path) -> None:
    """The checkpoint of a mode that keeps ranks in step: this rank's slices of what is sharded."""
    sharded_checkpoint = _sharded_checkpoint()
    ranks = _ranks(state)
    names = parameter_names(state.model)
    shards, whole = _shards(state), held_whole(state, lent, saving=False)
    model = sharded_checkpoint.model_state(state.model, whole, shards or {}, ranks)
    template, slices = sharded_checkpoint.load_template(
        path, model, state.model, state.optimizer, names, shards, ranks, whole
    )
    sharded_checkpoint.load(template, path, ranks)
    optim = template["optim"]
    optimizer_state = {
        name: {key: slices.get((name, key), value) for key, value in entries.items()}
        for name, entries in optim["state"].items()
    }
    sharded_checkpoint.load_optimizer(state.optimizer, names, optimizer_state, optim["param_groups"])
    state.schedule.load_state_dict(template.get("transpiler", {}).get("schedule", {}))
    state.extra = dict(template.get("transpiler", {}).get("extra", {}))


def _ranks(state: StepState) -> Ranks:
    """Where DCP's collectives run: on the step's group, so the step's timeout bounds a checkpoint too."""
    placement = state.placement
    return _sharded_checkpoint().Ranks(placement.rank, placement.world_size, live_group(placement))


def _replica(state: StepState) -> Any:  # replica_checkpoint.Replica (imported with the checkpoint modules)
    placement = state.placement
    return _replica_checkpoint().Replica.of(placement.rank, placement.world_size, state.replica_ranks)


def _shards(state: StepState) -> Shards | None:
    """This rank's ``[lo, hi)`` of each sharded parameter, once the step is built; None before."""
    return state.built.shards if state.built is not None else None
