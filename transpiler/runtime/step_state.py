"""The record every part of the runtime shares: what one ``DistributedStep`` holds, in named fields.

The step's jobs live in their own modules (the program cache, the ports, ZeRO-3's lent parameters, DiLoCo's
global weights, snapshots, DCP checkpoints, the memory report); each reads and writes this record, and none
keeps state of the step's anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.ports import PortKind
from transpiler.graph.program import Axis
from transpiler.strategies.schedules import Schedule

from .flat_storage import FlatStorage
from .process_group import Placement
from .program_cache import Built


@dataclass
class StepState:
    """A rank's step: the user's model and optimizers, where it runs, the schedule, and the state passes add."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    outer_optimizer: torch.optim.Optimizer | None  # DiLoCo's: steps θ_global at each sync
    placement: Placement
    schedule: Schedule
    mode_specs: dict[str, str]  # variant -> its pipeline spec
    replicated: bool  # all ranks hold the same model and optimizer (or its slices) after updates
    replica_ranks: tuple[int, ...]  # DiLoCo: the ranks of this rank's replica
    holds_param_slices: bool  # zero3: the model holds this rank's slices of its parameters between steps
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # pass-added state, by name
    built: Built | None = None  # the programs of the batch prepared last
    started: bool = False  # the startup program ran, or a checkpoint was loaded (which replaces it)
    lent: bool = False  # inside step.gathered() or step.global_weights(): the parameters are lent to a block
    flat: FlatStorage = field(default_factory=FlatStorage)  # the flat buffers the programs declare

    def last(self) -> Built:
        """The programs built last; an error before anything was traced."""
        if self.built is None:
            raise ConfigurationError("nothing traced yet: pass example_inputs to transpile() or run one step first.")
        return self.built

    def stage(self) -> tuple[Axis, frozenset[str]] | None:
        """On a pipeline: this rank's stage, and the ``model.state_dict()`` entries it holds current values of (its
        parameters and buffers; the model's others stay as they were made). None off a pipeline."""
        built = self.built
        program = next((p for p in built.programs.values() if p.stage is not None), None) if built else None
        if program is None:
            return None
        buffers = {p.name for p in program.inputs if p.kind == PortKind.BUFFER}
        return program.stage, frozenset(built.plan.held or ()) | buffers

    def refuse_under_pipeline(self, what: str) -> None:
        """An error for ``what`` on a step that runs one stage of a pipeline, where it is not built yet."""
        if self.stage() is not None:
            raise ConfigurationError(
                f"{what} is not built for a pipeline yet: each stage holds current values only for its own "
                "parameters. Save step.state_dict() on every rank with torch.save (it holds the rank's stage), and "
                "resume with step.load_state_dict() at the same stages."
            )

    def refuse_while_lent(self, what: str) -> None:
        if self.lent:
            raise ConfigurationError(
                f"{what} inside `with step.gathered():` or `with step.global_weights():`, where the parameters are "
                "lent to the block: leave the block first."
            )


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name in ``model`` (a tied one under its first name), by ``id``."""
    return {id(p): name for name, p in model.named_parameters()}
