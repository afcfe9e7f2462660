"""Checkpoints every N steps that a restarted job, at any world size, resumes from (docs/fault_tolerance.md).

A ``Checkpointer`` writes ``step.save_checkpoint`` folders into one directory that every rank sees (a shared
filesystem across hosts, as torch.distributed.checkpoint needs), with the data position beside them:

    <directory>/step-00000040/     complete: DCP's files, its .metadata and position.json
    <directory>/.partial-00000060/ being written: never read, and cleared before it is written again

A checkpoint becomes visible by one ``rename`` of its folder, after every rank has written its part, DCP's
coordinator its metadata, and rank 0 the position, so a job killed while saving leaves the last complete one
as the newest. The last ``keep`` are kept. ``resume()`` loads the newest at whatever world size the job now has
(``step.load_checkpoint`` reshards) and puts the data position back, so that no sample is skipped or repeated.
Its collectives run on the step's group, within the step's timeout, and a failed one is a CommunicationError
that names the ranks that went silent, as in a step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from transpiler.errors import CheckpointError, ConfigurationError

from .data_position import DataPosition
from .distributed_step import DistributedStep
from .failures import failures_named
from .process_group import live_group

COMPLETE = re.compile(r"^step-(\d{8})$")
POSITION = "position.json"


class Checkpointer:
    """Save ``step`` every ``every`` steps into ``directory`` (keeping the last ``keep``), and resume from the
    newest complete checkpoint there. Every rank makes one, with the same arguments, and calls
    :meth:`resume` once before training and :meth:`step_done` after each call of the step."""

    def __init__(
        self,
        step: DistributedStep,
        directory: str | os.PathLike,
        every: int,
        keep: int = 2,
        position: DataPosition | None = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"every must be a positive number of steps, got {every!r}.")
        if not isinstance(keep, int) or keep < 1:
            raise ConfigurationError(f"keep must be at least 1 (the checkpoint a restart reads), got {keep!r}.")
        self.step, self.directory, self.every, self.keep, self.position = step, Path(directory), every, keep, position
        self.steps = 0  # step calls completed since the start of training, over restarts
        self._due = False  # a save fell due inside an accumulation cycle: taken at the cycle's end

    def complete(self) -> list[Path]:
        """The complete checkpoints in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if COMPLETE.match(p.name) and (p / POSITION).is_file()]
        return sorted(found, key=lambda p: int(COMPLETE.match(p.name).group(1)))

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint, if there is one, into the step and the data position. Every rank
        must name the same directory and see rank 0's newest checkpoint there, or every rank raises a
        CheckpointError saying which ranks differ (a host restarted with other arguments, or storage that not
        every host sees), before any rank reads a byte. Returns the folder read (None: a fresh start)."""
        with failures_named(f"resuming from {self.directory}", self.step.placement):
            return self._resume(live_group(self.step.placement))

    def _resume(self, group: ProcessGroup | None) -> Path | None:
        newest = self.complete()
        views = _gathered((str(self.directory.resolve()), newest[-1].name if newest else None), group)
        if len({directory for directory, _ in views}) > 1:
            listed = "; ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(views))
            raise CheckpointError(
                f"the ranks resume from different checkpoint directories ({listed}). Start every "
                "rank with the same directory, on storage that every host sees."
            )
        chosen = views[0][1]
        if chosen is None:
            return None
        path = self.directory / chosen
        unseen = [r for r, sees in enumerate(_gathered(path in newest, group)) if not sees]
        if unseen:
            raise CheckpointError(
                f"rank 0 resumes from {path}, which ranks {unseen} do not see complete there: the checkpoint "
                "directory must be on storage that every host sees (a shared filesystem), as "
                "torch.distributed.checkpoint needs."
            )
        saved = json.loads((path / POSITION).read_text())
        self.step.load_checkpoint(path)
        self.steps = int(saved["steps"])
        if self.position is not None:
            if "data" not in saved:
                raise CheckpointError(f"{path} holds no data position; resume it without one (position=None).")
            self.position.load_state_dict(saved["data"])
        return path

    def step_done(self) -> Path | None:
        """Count one call of the step, and save when ``every`` steps have passed since the last save, or at the
        first call after that leaves no half-accumulated gradient and no Streaming DiLoCo exchange in flight
        (``step.checkpoint_blocked()``). Returns the folder written, if one was."""
        self.steps += 1
        self._due = self._due or self.steps % self.every == 0
        if not self._due or self.step.checkpoint_blocked() is not None:
            return None
        return self.save()

    def save(self) -> Path:
        """Write a checkpoint of the step now, visible only once complete; drop the oldest beyond ``keep``."""
        final = self.directory / f"step-{self.steps:08d}"
        with failures_named(f"writing the checkpoint {final}", self.step.placement):
            self._save(final, live_group(self.step.placement))
        self._due = False
        return final

    def _save(self, final: Path, group: ProcessGroup | None) -> None:
        rank = self.step.placement.rank
        partial = self.directory / f".partial-{self.steps:08d}"
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a job killed while saving
        _barrier(group)
        self.step.save_checkpoint(partial)  # returns once DCP's coordinator has written the metadata
        if rank == 0:
            record = {"steps": self.steps}
            if self.position is not None:
                record["data"] = self.position.state_dict()
            (partial / POSITION).write_text(json.dumps(record))
            shutil.rmtree(final, ignore_errors=True)  # the same step saved by an earlier attempt
            partial.rename(final)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier(group)  # every rank sees the checkpoint before it goes on


def _barrier(group: ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


def _gathered(value: object, group: ProcessGroup | None) -> list:
    """Every rank's ``value``, in rank order (``group`` spans every rank, in order)."""
    if group is None:
        return [value]
    out: list = [None] * group.size()
    dist.all_gather_object(out, value, group=group)
    return out
