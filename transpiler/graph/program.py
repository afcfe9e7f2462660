"""The step program: a rewritten graph plus the facts passes share about it.

Everything a pass learns or adds travels in ``node.meta`` or in this object,
never in hidden module state, so a program can be copied, printed, compared
across ranks and run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.fx as fx

from transpiler.errors import ConfigurationError

from .cost_model import CostModel, LinkCost
from .op_counts import OpCounts, op_counts
from .ports import ExtraInit, Port

ROLES = ("forward", "loss", "loss_grad", "backward", "communication", "optimizer")


@dataclass(frozen=True)
class ParamBucket:
    """A bucket of parameters held sharded between steps (ZeRO-3, ``shard-params``): their names, where each
    starts in the bucket's flat buffer, the buffer's length (a multiple of the world size: rank r holds elements
    ``[r * length / W, (r + 1) * length / W)``) and each parameter's whole shape."""

    names: tuple[str, ...]
    starts: tuple[int, ...]
    length: int
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class FlatBuffer:
    """One flat input of the program that holds tensors the user sees one by one (``flatten-update``): the
    parameters of a bucket, or one optimizer-state entry of a run of them. The runtime allocates it once and
    binds each parameter's ``.data`` (``kind="param"``), or its ``optimizer.state[p][key]`` (``kind="state"``),
    to the view of ``shapes[i]`` at ``starts[i]``; the program reads and writes the buffer whole.

    ``spans[i]`` are the elements of parameter ``names[i]`` that the view holds: all of them, or this rank's
    ``[lo, hi)`` under a sharded optimizer (the view is then 1-D). A 0-d state entry (Adam's ``step``) has one
    element per parameter, a *lane*: every lane of a run holds the same value, since one update serves them all.
    Elements no view covers (alignment padding) are zero when allocated and never read by a user's tensor."""

    port: str
    kind: str  # "param" or "state"
    key: str  # the state key ("" for parameters)
    names: tuple[str, ...]
    starts: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[int, int], ...]
    length: int
    dtype: str
    device: str


@dataclass(frozen=True)
class Axis:
    """One dimension of a 2-D layout of the ranks (DiLoCo across replicas of data-parallel ranks, as HSDP): how
    many ranks it spans, this rank's place among them, and their process group. A pass whose ``axis`` option
    names it sees these as the program's ``world_size``, ``rank`` and ``group_name`` while it runs."""

    world_size: int
    rank: int
    group_name: str


@dataclass(frozen=True)
class OuterUpdate:
    """An outer optimizer's update, traced on its own (DiLoCo's outer step), for a pass to inline into a step
    program. Inputs: ``param`` (the weights it updates), ``grad`` (what it reads as their gradients), ``state``
    (``<param>.<key>``) and ``scalar`` (its per-step slots); outputs: the new ``param`` and ``state``."""

    graph_module: fx.GraphModule
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]


@dataclass
class StepProgram:
    """A rank's training-step graph and the context the pipeline keeps beside it."""

    graph_module: fx.GraphModule
    inputs: list[Port]
    outputs: list[Port]
    world_size: int = 1
    rank: int = 0
    group_name: str = "default"
    startup: fx.GraphModule | None = None
    startup_ports: list[Port] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)
    extra_init: dict[str, ExtraInit] = field(default_factory=dict)  # extra input -> how the runtime makes it
    subgroups: dict[tuple[int, ...], str] = field(default_factory=dict)  # ranks -> process-group name
    sources: dict[str, str] = field(default_factory=dict)  # data files baked into the graph -> content digest
    cost_model: CostModel | None = None  # measured at startup when a pass asks (bucket_cap_mb="auto")
    link_cost: LinkCost | None = None  # measured at startup when a pass asks (zero3's bucket_cap_mb="cost")
    op_scratch: dict[str, int] = field(default_factory=dict)  # an op's scratch bytes by its call (graph/memory.py)
    decisions: dict[str, str] = field(default_factory=dict)  # pass -> what it chose from measurements, in words
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)  # param -> flat [lo, hi) this rank updates
    param_buckets: list[ParamBucket] = field(default_factory=list)  # parameters held as shards (ZeRO-3)
    param_groups: dict[str, int] = field(default_factory=dict)  # trainable param -> its optimizer param group
    flat_buffers: list[FlatBuffer] = field(default_factory=list)  # flat inputs the runtime binds (flatten-update)
    op_counts: list[tuple[str, OpCounts]] = field(default_factory=list)  # per stage: the ops its graph dispatches
    outer_update: OuterUpdate | None = None  # the outer optimizer's update, traced for a pass to inline (DiLoCo)
    axes: dict[str, Axis] = field(default_factory=dict)  # a 2-D layout's dimensions, by name (none: one dimension)
    shard_axis: str = "world"  # the ranks whose ``shards`` tile every parameter (ZeRO inside a DiLoCo replica)
    stage: Axis | None = None  # the pipeline stage this program runs, among the stages (split-stages)
    pipeline_grads: tuple[str, ...] = ()  # every stage's trained parameters, in model order (a global norm's order)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def recompile(self) -> None:
        self.graph_module.recompile()

    def snapshot(self, label: str, code: str | None = None) -> None:
        """Keep the code after a stage, and the ops it dispatches, so 'the graph after pass X' is a lookup.
        ``code``: the graph module's, when it was just recompiled; else made here as ``recompile()`` makes it."""
        self.history.append((label, code if code is not None else self.graph.python_code(root_module="self").src))
        self.op_counts.append((label, op_counts(self.graph)))

    @contextlib.contextmanager
    def on_axis(self, name: str) -> Iterator[None]:
        """Inside, the program's world size, rank and group are those of its axis ``name`` ("world": as they
        are)."""
        if name == "world":
            yield
            return
        axis = self.axes.get(name)
        if axis is None:
            raise ConfigurationError(
                f"a pass works across the ranks of axis '{name}', and this program has "
                f"{', '.join(self.axes) or 'no axes'}: a 2-D layout (replica_size=...) declares them."
            )
        saved = (self.world_size, self.rank, self.group_name)
        self.world_size, self.rank, self.group_name = axis.world_size, axis.rank, axis.group_name
        try:
            yield
        finally:
            self.world_size, self.rank, self.group_name = saved

    def clone(self, *, rank: int | None = None) -> StepProgram:
        """A deep copy whose graph can be rewritten without touching this one: the graphs copied, every list
        and dict field copied shallowly (ports, buckets and layouts are immutable), the rest shared."""
        program = self.sharing_graphs()
        program.own_graphs()
        if rank is not None:
            program.rank = rank
        return program

    def sharing_graphs(self) -> StepProgram:
        """A copy whose fields can be set without touching this one, its graphs still this one's: what a build
        starts from, which rewrites only clones of it (a trace kept for reuse is handed out so, not deep-copied)."""
        return StepProgram(
            **{
                f.name: copy.copy(value) if isinstance(value := getattr(self, f.name), list | dict) else value
                for f in dataclasses.fields(self)
            }
        )

    def own_graphs(self) -> None:
        """Give this program copies of its graphs, before rewriting them in place."""
        self.graph_module = fx.GraphModule(self.graph_module, copy.deepcopy(self.graph_module.graph))
        if self.startup is not None:
            self.startup = fx.GraphModule(self.startup, copy.deepcopy(self.startup.graph))
