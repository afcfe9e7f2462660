"""Where training stands in its data, kept so that a restart at another world size sees every sample once.

``DistributedSampler`` cuts each epoch's permutation into one strided shard per rank, fixed for the epoch; after
a restart at another world size the shards no longer line up with what was consumed. Here the unit of progress
is the *global* batch: each epoch's permutation depends only on ``(seed, epoch)``, the world consumes it
``global_batch`` samples at a time, and each rank takes its contiguous part of the current global batch. The
position is ``(epoch, offset)``, the count of samples the world has consumed this epoch, which means the same
at any world size: resumed at W=2 from a W=4 checkpoint, the next global batch starts where W=4 stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from transpiler.errors import CheckpointError, ConfigurationError


@dataclass
class DataPosition:
    """Epoch and offset (samples consumed this epoch, over all ranks) in a dataset of ``size`` samples read in
    global batches of ``global_batch``; ``seed`` fixes every epoch's shuffle. A last partial global batch is
    dropped, as ``drop_last=True`` does, so that every step has the same shape."""

    size: int
    global_batch: int
    seed: int = 0
    epoch: int = 0
    offset: int = 0
    _drawn: tuple[int, torch.Generator] | None = field(default=None, init=False, repr=False, compare=False)
    _last: tuple[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.global_batch <= self.size:
            raise ConfigurationError(
                f"global_batch must be between 1 and the dataset size {self.size}, got {self.global_batch}."
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation: the ``epoch + 1``-th ``randperm`` of a generator seeded with ``seed``
        (what a loop drawing one permutation per epoch from one generator sees), the same on every rank. The
        generator is kept between epochs, so that a run draws each permutation once, not ``epoch + 1`` times, and
        the last permutation is kept, since a quorum's steps ask for it every step (:meth:`quorum_part`)."""
        if self._last is not None and self._last[0] == epoch:
            return self._last[1]
        drawn, generator = self._drawn or (0, torch.Generator().manual_seed(self.seed))
        if drawn > epoch:
            drawn, generator = 0, torch.Generator().manual_seed(self.seed)
        for _ in range(epoch - drawn):
            torch.randperm(self.size, generator=generator)
        order = torch.randperm(self.size, generator=generator)
        self._drawn, self._last = (epoch + 1, generator), (epoch, order)
        return order

    def epoch_batches(self, rank: int, world: int) -> Iterator[torch.Tensor]:
        """This rank's sample indices for each remaining global batch of the current epoch. The position moves
        past a batch when it is handed out, so a checkpoint written after the step on it counts it as consumed;
        at the end of the epoch it moves to the next epoch's start."""
        if self.global_batch % world:
            raise ConfigurationError(
                f"the global batch {self.global_batch} does not split evenly over {world} ranks; choose a global "
                "batch divisible by every world size the job may run at."
            )
        per_rank = self.global_batch // world
        order = self.order(self.epoch)
        while self.offset + self.global_batch <= self.size:
            start = self.offset + rank * per_rank
            self.offset += self.global_batch
            yield order[start : start + per_rank]
        self.epoch, self.offset = self.epoch + 1, 0

    def quorum_part(self, index: int, participants: int) -> torch.Tensor:
        """Under a quorum (``transpile(fault_tolerance=...)``): replica ``index`` of ``participants``'s samples
        for the next step, ``global_batch`` of them (here the batch of *one* replica), taken in the epoch's order
        after the last committed step's. Nothing moves until :meth:`commit`, so the samples of a step that does
        not commit are drawn again by the next one, under whatever quorum it has. An epoch whose rest is too
        short for all participants ends there."""
        if participants * self.global_batch > self.size:
            raise ConfigurationError(
                f"{participants} replica groups of {self.global_batch} samples each need more than the dataset's "
                f"{self.size}: use a smaller batch per group."
            )
        if self.offset + participants * self.global_batch > self.size:
            self.epoch, self.offset = self.epoch + 1, 0
        start = self.offset + index * self.global_batch
        return self.order(self.epoch)[start : start + self.global_batch]

    def commit(self, participants: int) -> None:
        """A step of ``participants`` replicas committed: their samples are consumed."""
        self.offset += participants * self.global_batch

    def batches_left(self, epochs: int) -> int:
        """Global batches left before epoch ``epochs`` starts (a run of ``epochs`` epochs ends there), the one
        under way included: 1 at a run's last step."""
        return max(0, (epochs - self.epoch) * self.steps_per_epoch - self.offset // self.global_batch)

    def state_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("size", "global_batch", "seed", "epoch", "offset")}

    def load_state_dict(self, state: dict[str, int], *, own_order: bool = False) -> None:
        """Take the saved epoch and offset; the dataset size, global batch and seed must be the saved ones, or
        the saved offset would point into another permutation. ``own_order``: the state is a peer's that reads the
        same data in an order of its own (DiLoCo's replica groups, each with its seed): only how far it has come
        is taken, and the seed may differ."""
        for key in ("size", "global_batch") if own_order else ("size", "global_batch", "seed"):
            if state.get(key) != getattr(self, key):
                raise CheckpointError(
                    f"the checkpoint's data position was saved with {key}={state.get(key)}, and this run has "
                    f"{key}={getattr(self, key)}: resuming would skip or repeat samples. Restart with the saved "
                    "setting, or start a new run without resuming."
                )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
