"""``PipelineParallel``: the pipeline dimension of a step (``transpile(..., pipeline=PipelineParallel(...))``).

The model is cut into ``stages`` at the inputs of the modules named in ``split_points`` (without them, at blocks of
the model's longest ``ModuleList`` or ``Sequential``, chosen so that the stages' estimated times are balanced:
``passes/stage_balance.py``); each rank of the pipeline's group runs one stage on ``microbatches`` equal parts of
its batch, in the order ``schedule`` gives (``passes/split_stages.py``, docs/strategies/pipeline.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.config import Config, own
from transpiler.graph.stage_orders import SCHEDULES, refusal


@dataclass(frozen=True, kw_only=True, repr=False)
class PipelineParallel(Config):
    """The stages, microbatches, schedule and split points of a pipeline. ``split_points``: module names (as
    ``model.named_modules()`` gives them), one per chunk after the first (a chunk per stage, or ``virtual_stages``
    per stage under ``interleaved_1f1b``: chunk ``c`` on stage ``c % stages``); each chunk starts at the input of its
    module, which must be all that the modules after it read of the modules before (a block of a transformer)."""

    stages: int = own(kind=int, minimum=2, help="pipeline stages, one per rank of the pipeline's group")
    microbatches: int = own(kind=int, minimum=1, help="equal parts each batch is cut into along dim 0")
    schedule: str = own("1f1b", choices=SCHEDULES, help="the order of each stage's forwards and backwards")
    split_points: tuple[str, ...] = dataclasses.field(default=())
    virtual_stages: int = own(1, kind=int, minimum=1, help="chunks of the model per rank (interleaved_1f1b: 2 or more)")

    def check(self) -> None:
        points = self.split_points
        if isinstance(points, str):
            points = tuple(p.strip() for p in points.split(",") if p.strip())
        if not isinstance(points, (tuple, list)) or not all(isinstance(p, str) for p in points):
            raise ConfigurationError(
                f"split_points must be module names (a tuple of str, or one comma-separated str); got {points!r}."
            )
        object.__setattr__(self, "split_points", tuple(points))
        refused = refusal(self.schedule, self.stages, self.microbatches, self.virtual_stages)
        if refused is not None:
            raise ConfigurationError(refused)
        chunks = self.chunks
        if points and len(points) != chunks - 1:
            each = f" of {self.virtual_stages} chunks" if self.virtual_stages > 1 else ""
            what = f"{self.stages} stages{each}"
            raise ConfigurationError(
                f"{what} need {chunks - 1} split points (one per chunk after the first); got {len(points)}: "
                f"{list(points)}."
            )

    @property
    def chunks(self) -> int:
        """The pieces the model is cut into: ``virtual_stages`` per rank."""
        return self.stages * self.virtual_stages

    def points_for(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The split points given, or every block of the longest block list: the candidates a balanced cut
        chooses ``stages - 1`` of (``passes/stage_balance.py``)."""
        if self.split_points:
            return self.split_points
        name, blocks = longest_block_list(model)
        if len(blocks) < self.chunks:
            raise ConfigurationError(
                f"{self.chunks} chunks of the model, and its longest ModuleList or Sequential "
                f"({name or 'none'}) has {len(blocks)} blocks: give split_points=(...) by module name."
            )
        return tuple(f"{name}.{block}" if name else block for block in blocks)


def longest_block_list(model: torch.nn.Module) -> tuple[str, list[str]]:
    """The ``ModuleList`` or ``Sequential`` of the model with the most children (the first, in a tie): its name
    and its children's names."""
    best: tuple[str, list[str]] = ("", [])
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = [child for child, _ in module.named_children()]
            if len(children) > len(best[1]):
                best = (name, children)
    return best
