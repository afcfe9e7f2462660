"""Where a pipeline's stages start when the user names no split points: the cut balanced by estimated time.

The step is traced with a mark at the input of every block of the model's longest block list (``split_points``
every one of them), so the trace falls into segments: what runs before the first block, each block, the rest after
the last one in the last block's segment. ``cut_stages`` gives each node its segment (a block's forward, its
backward and its parameters' update alike); a segment's estimated time is the sum over its nodes of the roofline
estimate ``recompute_cost.recompute_seconds`` plus a fixed dispatch cost per op (a narrow model's step is
dispatching more than arithmetic), a node of the forward or backward counted once per microbatch. The stages are
the contiguous runs of segments whose largest time is least (dynamic programming over the boundaries; a tie goes
to the cut whose largest stage holds the fewest bytes of parameters and optimizer state). ``keep_marks`` then
takes the other marks out of the graph: a mark is a copy forward and the identity backward, so the graph left is
the one a trace with only the chosen split points gives.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

import torch

from transpiler.graph.ports import PortKind
from transpiler.graph.program import StepProgram
from transpiler.graph.stage_ops import STAGE_INPUT, STAGE_INPUT_GRAD

from .recompute_cost import recompute_seconds
from .stage_cut import cut_stages

DISPATCH_SECONDS = 4e-6  # an eager op's fixed cost on a CPU host (its order of magnitude)
HELD = (PortKind.PARAM, PortKind.STATE, PortKind.BUFFER)


@dataclass(frozen=True)
class BalancedCut:
    """The segments' estimates and the stages chosen over them."""

    seconds: tuple[float, ...]  # each segment's estimated time per step
    held_bytes: tuple[int, ...]  # each segment's parameters, optimizer state and buffers
    starts: tuple[int, ...]  # the segment each stage after the first starts at

    def stage_seconds(self) -> list[float]:
        return [sum(self.seconds[a:b]) for a, b in self._runs()]

    def stage_bytes(self) -> list[int]:
        return [sum(self.held_bytes[a:b]) for a, b in self._runs()]

    def _runs(self) -> list[tuple[int, int]]:
        bounds = (0, *self.starts, len(self.seconds))
        return list(itertools.pairwise(bounds))


def segment_costs(program: StepProgram, microbatches: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Each segment's estimated time and held bytes, in a step traced with a mark at every candidate."""
    segments = 1 + sum(1 for n in program.graph.nodes if n.target is STAGE_INPUT)
    cut = cut_stages(program, segments)
    seconds = [0.0] * segments
    for node, holders in cut.holders.items():
        if node.op != "call_function" or node.target in (STAGE_INPUT, STAGE_INPUT_GRAD):
            continue  # a mark is no work: a segment of marks alone is empty
        once = recompute_seconds(node) + (DISPATCH_SECONDS if isinstance(node.target, torch._ops.OpOverload) else 0)
        runs = microbatches if node in cut.per_microbatch else 1
        for segment in holders:
            seconds[segment] += once * runs
    held = [0] * segments
    for node in program.graph.nodes:
        port = node.meta.get("port") if node.op == "placeholder" else None
        if port is not None and port.kind in HELD and port in cut.owner:
            value = node.meta["val"]
            held[cut.owner[port]] += value.numel() * value.element_size()
    return tuple(seconds), tuple(held)


def balance(seconds: tuple[float, ...], held_bytes: tuple[int, ...], stages: int) -> BalancedCut:
    """The contiguous runs of ``stages`` segments whose largest estimated time is least (then largest bytes),
    among those where every stage does some work where there are such: a stage of no ops (the segment before the
    first block, when the model's first block reads the batch) would hand its input on untouched, and the first
    stage would have nothing to send."""
    n = len(seconds)
    prefix_s = list(itertools.accumulate(seconds, initial=0.0))
    prefix_b = list(itertools.accumulate(held_bytes, initial=0))

    @cache
    def best(first: int, count: int) -> tuple[tuple[float, int], tuple[int, ...]]:
        """The best cut of segments ``first..n-1`` into ``count`` runs: its (any run empty, largest time, bytes),
        its starts."""
        run = (prefix_s[n] <= prefix_s[first], prefix_s[n] - prefix_s[first], prefix_b[n] - prefix_b[first])
        if count == 1:
            return run, ()
        options = []
        for end in range(first + 1, n - count + 2):
            empty = prefix_s[end] <= prefix_s[first]
            head = (empty, prefix_s[end] - prefix_s[first], prefix_b[end] - prefix_b[first])
            rest, starts = best(end, count - 1)
            options.append(((head[0] or rest[0], max(head[1], rest[1]), max(head[2], rest[2])), (end, *starts)))
        return min(options)

    _, starts = best(0, stages)
    return BalancedCut(seconds, held_bytes, starts)


def keep_marks(program: StepProgram, starts: tuple[int, ...]) -> None:
    """Keep the marks of the segments in ``starts`` (numbered 1, 2, ... as stages) and take the others out."""
    renumber = {segment: k + 1 for k, segment in enumerate(starts)}
    graph = program.graph
    for node in list(graph.nodes):
        if node.target not in (STAGE_INPUT, STAGE_INPUT_GRAD):
            continue
        segment = node.args[1]
        if segment in renumber:
            node.args = (node.args[0], renumber[segment])
        else:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    program.graph_module.recompile()
