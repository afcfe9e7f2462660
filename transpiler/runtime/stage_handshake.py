"""The stages of a pipeline agree before they run: the same settings, and every send meeting the receive that waits
for it. A stage given other settings (microbatches, a schedule, split points) or another batch shape would otherwise
wait in a receive until the group's timeout and fail there with gloo's words; here it fails at once, saying which
stage differs and how."""

from __future__ import annotations

import torch.distributed as dist
import torch.fx as fx

from transpiler.errors import RankMismatchError
from transpiler.graph.program import Axis, StepProgram
from transpiler.graph.stage_ops import RECV, SEND

Message = tuple[int, int, tuple[int, ...], str]  # (peer stage, tag, shape, dtype)


def messages(graph: fx.Graph) -> dict[str, list[Message]]:
    """The program's sends and receives, each as (peer, tag, shape, dtype), in program order."""
    out: dict[str, list[Message]] = {"sends": [], "recvs": []}
    for node in graph.nodes:
        if node.target is SEND:
            value = node.args[0].meta["val"]
            out["sends"].append((node.args[2], node.args[3], tuple(value.shape), str(value.dtype)))
        elif node.target is RECV:
            shape, dtype, _, _, peer, tag = node.args[:6]
            out["recvs"].append((peer, tag, tuple(shape), str(dtype)))
    return out


def agree(program: StepProgram, stage: Axis, settings: dict) -> None:
    """Exchange every stage's settings and messages over the pipeline's group; a ``RankMismatchError`` for the
    first stage whose settings differ from this one's, or whose receives from this stage are not its sends."""
    mine = {"settings": settings, **messages(program.graph)}
    gathered: list[dict] = [{} for _ in range(stage.world_size)]
    dist.all_gather_object(gathered, mine, group=dist.distributed_c10d._resolve_process_group(stage.group_name))
    for other, theirs in enumerate(gathered):
        if theirs["settings"] != settings:
            raise RankMismatchError(
                f"pipeline stage {other} was built with {theirs['settings']}, stage {stage.rank} with {settings}: give "
                "every rank the same PipelineParallel and batch shapes."
            )
        sent = [m[1:] for m in mine["sends"] if m[0] == other]
        received = [m[1:] for m in theirs["recvs"] if m[0] == stage.rank]
        if sorted(sent) != sorted(received):
            raise RankMismatchError(
                f"pipeline stage {stage.rank} sends stage {other} {sent} (tag, shape, dtype) and stage {other} "
                f"receives {received}: the stages cut the step differently. Give every rank the same model."
            )
