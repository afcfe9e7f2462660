"""Weight trajectories: the snapshots a PCA basis is built from (the first half of DimReduce, issue 8).

``transpile(..., execution=Execution(save_trajectory=DIR, trajectory_every=m))`` makes rank 0 save
the trainable parameters every ``m`` optimizer updates (accumulation
micro-steps do not count) as ``DIR/step_<t>.pt``: ``{"step": t, "weights":
flat float32 vector, "names": [...], "shapes": [...]}``, in the layout of
``graph/basis.py``. ``torch.load(path, weights_only=True)`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from transpiler.graph.basis import flat_weights, layout
from transpiler.strategies.schedules import ACCUMULATE


@dataclass
class TrajectoryWriter:
    """Saves the weights every ``every`` updates; only the rank that owns one calls it (rank 0)."""

    directory: Path
    every: int
    updates: int = 0

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def __call__(self, model: torch.nn.Module, variant: str) -> None:
        """Called after every step; accumulation micro-steps (variant ``accumulate...``) update nothing."""
        if variant.startswith(ACCUMULATE):
            return
        self.updates += 1
        if self.updates % self.every:
            return
        names, shapes = layout(model)
        snapshot = {"step": self.updates, "weights": flat_weights(model), "names": names, "shapes": shapes}
        torch.save(snapshot, self.directory / f"step_{self.updates:08d}.pt")
