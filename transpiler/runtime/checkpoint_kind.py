"""What a checkpoint was written by, and what may read it: one check for both kinds of checkpoint.

A snapshot (``step.state_dict()``) resumes exactly, so it is read only by a step of the same mode, world size,
schedule settings and optimizers. A DCP checkpoint (``step.save_checkpoint()``) reshards, so any world size and
mode reads it, provided the optimizers are the same and its layout is the reader's: a row per replica (DiLoCo),
or every rank in step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transpiler.errors import CheckpointError, RenamedWarning
from transpiler.graph.renames import current_spec

from .step_state import StepState

CHECKPOINT_FORMAT = 2
REPLICAS = "replicas"  # the layout of DiLoCo's DCP checkpoints: a row of weights and inner state per replica


@dataclass(frozen=True)
class CheckpointKind:
    """A step as its checkpoints describe it."""

    optimizer: str
    outer_optimizer: str | None
    mode: dict[str, str]
    world_size: int
    schedule: dict[str, Any]
    stage: str | None  # a pipeline's: "k of p"

    @classmethod
    def of(cls, state: StepState) -> CheckpointKind:
        outer, stage = state.outer_optimizer, state.stage()
        return cls(
            optimizer=type(state.optimizer).__qualname__,
            outer_optimizer=type(outer).__qualname__ if outer is not None else None,
            mode=state.mode_specs,
            world_size=state.placement.world_size,
            schedule=state.schedule.settings(),
            stage=None if stage is None else f"{stage[0].rank} of {stage[0].world_size}",
        )

    def setup(self) -> dict[str, Any]:
        """What a snapshot records, and must share with the step it is loaded into."""
        return {
            "mode": self.mode,
            "world size": self.world_size,
            "schedule": self.schedule,
            "optimizer": self.optimizer,
            **({"outer optimizer": self.outer_optimizer} if self.outer_optimizer else {}),
            **({"pipeline stage": self.stage} if self.stage else {}),
        }

    def record(self) -> dict[str, Any]:
        """What a DCP checkpoint records, and its reader must match: the format, the optimizers, the layout."""
        kind: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "optimizer": self.optimizer}
        if self.outer_optimizer is not None:
            kind |= {"outer optimizer": self.outer_optimizer, "layout": REPLICAS}
        return kind

    def check(self, saved_format: Any, saved: dict[str, Any], *, resharding: bool, path: str | Path = "") -> list[str]:
        """Whether this step may read a checkpoint written in format ``saved_format`` by a step that recorded
        ``saved`` (:meth:`record` for DCP, ``resharding``; else :meth:`setup`). What it cannot read at all raises a
        CheckpointError saying what to do instead; for a snapshot, the settings that differ are returned, for the
        caller to report beside the model's differences."""
        if resharding and (saved_format != CHECKPOINT_FORMAT or saved.get("optimizer") != self.optimizer):
            raise CheckpointError(
                f"the checkpoint holds {saved.get('optimizer')} state in format {saved_format}; this step's optimizer "
                f"is {self.optimizer} and it reads format {CHECKPOINT_FORMAT}."
            )
        if saved_format != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"checkpoint format {saved_format!r}, this version reads {CHECKPOINT_FORMAT}; load its 'model' and "
                "'optimizer' entries with model.load_state_dict() and optimizer.load_state_dict()."
            )
        if not resharding:
            mine = self.setup()
            saved = {**saved, "mode": current_specs(saved.get("mode"))}
            return [f"{k}: checkpoint {v!r}, this step {mine.get(k)!r}" for k, v in saved.items() if mine.get(k) != v]
        layout = REPLICAS if self.outer_optimizer is not None else None
        if saved.get("layout") == layout == REPLICAS and saved.get("outer optimizer") != self.outer_optimizer:
            raise CheckpointError(
                f"the checkpoint holds {saved.get('outer optimizer')} outer state; this step's outer optimizer "
                f"is {self.outer_optimizer}."
            )
        if saved.get("layout") == REPLICAS and layout is None:
            raise CheckpointError(
                f"{path} was written by a DiLoCo step (a row of weights and inner state per replica), and this "
                "step's mode keeps every rank in step. To start from its global weights, read its 'model' entry "
                "into the model with torch.distributed.checkpoint.load before transpile() (docs/checkpoints.md)."
            )
        if saved.get("layout") != REPLICAS and layout == REPLICAS:
            raise CheckpointError(
                f"{path} was written in a mode that keeps every rank in step, and a DiLoCo step reads only DiLoCo "
                "checkpoints. To start DiLoCo from it (the paper's warm start), read it into the model and the "
                "inner optimizer with torch.distributed.checkpoint before transpile() (docs/checkpoints.md)."
            )
        return []


def current_specs(mode: Any) -> Any:
    """A snapshot's recorded pipelines (variant -> spec) with options renamed since it was written by their new
    names, and a warning saying so; anything else as it is."""
    if not isinstance(mode, dict):
        return mode
    current = {variant: current_spec(spec) if isinstance(spec, str) else spec for variant, spec in mode.items()}
    if current != mode:
        warnings.warn(
            "the checkpoint names pass options by names they had before issue 73 (compress, chunk, exchange...); "
            "it is read with their new names. Save it again to write those.",
            RenamedWarning,
            stacklevel=4,
        )
    return current
