"""From a model, an optimizer and a strategy to one rank's programs: what ``transpile()`` hands the step, and what
the step calls for every new cache key (a new batch shape, model mode or structure).

:class:`StepBuilder` traces the step, measures the cost model where a pass asks for one, rewrites the trace per
program variant for this rank (without a live world, checking all ranks' programs against each other), and
describes the setup the ranks compare before it runs (in a live world, the cross-rank check). What one build
learns that a later one must reuse is a named field of it: the slices a sharded mode gave this rank, the whole
shapes of parameters held as slices, the measured costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from passes.registry import PASSES
from transpiler.graph.collectives import communication_plan
from transpiler.graph.cost_model import CostModel, LinkCost
from transpiler.graph.pipeline import Pass, Pipeline
from transpiler.graph.program import Axis, StepProgram
from transpiler.graph.verify import (
    DEFAULT_VERIFIERS,
    check_communication,
    check_cross_rank,
    check_fragments,
    check_output_shapes,
    check_shards,
    shard_place,
)
from transpiler.runtime import cost_probe, host_memory, op_scratch, stage_handshake
from transpiler.runtime import cuda_graph as cuda_graph_module
from transpiler.runtime.compile import CompiledProgram
from transpiler.runtime.cuda_graph import CapturedProgram
from transpiler.runtime.execution import Execution
from transpiler.runtime.handshake import Setup, describe_model, describe_optimizer
from transpiler.runtime.plain_runner import PlainRunner, runs_on_gpu
from transpiler.runtime.process_group import Placement
from transpiler.runtime.program_cache import Built, batch_key
from transpiler.strategies.pipeline_parallel import PipelineParallel
from transpiler.strategies.schedules import ACCUMULATE, Schedule
from transpiler.strategies.strategy import RankPlan, Strategy
from transpiler.trace.environment import AutocastState
from transpiler.trace.outer import trace_outer_update
from transpiler.trace.signature import StepTrace
from transpiler.trace.tensor_parallel import tensor_parallel_of
from transpiler.trace.trace_cache import TraceCache
from transpiler.trace.tracer import LossFn, trace_step

from .errors import ConfigurationError

log = logging.getLogger("transpiler")
CROSS_RANK_LIMIT = 16  # beyond this many ranks, the static check compares ranks 0, 1 and W-1
Axes = Sequence[dict[str, tuple[int, ...]]]  # per rank of the world: each axis's ranks


@dataclass
class StepBuilder:
    """Builds this rank's programs for one cache key (``DistributedStep`` calls it)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    outer: torch.optim.Optimizer | None  # DiLoCo's outer optimizer, traced beside the step
    strategy: Strategy
    plan: RankPlan
    placement: Placement
    subgroups: dict[tuple[int, ...], str]  # the strategy's process groups by their ranks
    execution: Execution = field(default_factory=Execution)
    # ``transpile(trace=...)``: a trace made ahead, for the first build; or a cache that serves every build
    reuse: StepTrace | TraceCache | None = None
    pipeline: PipelineParallel | None = None  # a pipeline's stages, microbatches and schedule
    stage: Axis | None = None  # this rank's place in the pipeline (axis 'pp')
    # learnt by earlier builds: a sharded mode's slices of this rank (None: no mode shards), the whole shape of
    # each parameter ZeRO-3 holds as a slice, and the cost model measured per batch shape
    shards: dict[str, tuple[int, int]] | None = field(init=False)
    whole: dict[str, tuple[int, ...]] = field(init=False, default_factory=dict)
    measured: dict[tuple, CostModel] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.shards = {} if any(p.shards_state for p in self.strategy.passes()) else None

    def __call__(self, batch: tuple, autocast: AutocastState) -> Built:
        check_frozen_whole(self.model, self.whole)
        traced_batch = microbatch_of(batch, self.pipeline.microbatches) if self.pipeline is not None else batch
        args = (self.model, self.optimizer, self.loss_fn, traced_batch, autocast, self.shards, self.whole)
        if self.pipeline is not None:
            points = self.pipeline.points_for(self.model)
            trace, state, plan = trace_step(*args, split_points=points)
            split_stage(trace.program, self.pipeline, self.stage, self.execution, points)
            if self.placement.live:
                settings = self.pipeline.to_dict() | {"batch": [list(t.shape) for t in batch]}
                stage_handshake.agree(trace.program, self.stage, settings)
            plan.held = frozenset(p.name for p in trace.program.outputs if p.kind == "param")
        elif isinstance(self.reuse, TraceCache):
            trace, state, plan = self.reuse.signed(*args)
        else:
            trace, state, plan = trace_step(*args, reuse=self.reuse)
            self.reuse = None  # later cache keys (shapes, modes) trace anew
        traced = trace.program
        outer_plan = None
        if self.outer is not None:
            traced.outer_update, outer_plan = trace_outer_update(self.outer, state)
            if self.pipeline is not None:  # a stage's scalars (SGD's first momentum step) read its own state
                outer_plan.held = plan.held
        traced.cost_model = self._cost_model(batch)
        fit_budget(traced, self.plan.variants, self.execution)
        traced.link_cost = self._link_cost()
        programs = {
            variant: rewrite(
                traced,
                passes,
                self.placement,
                verify=self.execution.verify,
                on_pass=self.execution.on_pass,
                subgroups=self.subgroups,
                axes=self.plan.axes,
            )
            for variant, passes in self.plan.variants.items()
        }
        if self.outer is not None and self.execution.verify:
            every = self.plan.schedule.settings()["sync_every"]
            check_fragments(programs, updates_of(self.strategy.fresh_schedule(), 3 * every), every)
        if self.execution.keep_freed_memory and host_memory.runs_on_cpu(programs.values()):
            kept = host_memory.keep_freed_memory(programs.values())
            for program in programs.values():
                program.decisions["keep-freed-memory"] = kept
        for program in programs.values() if self.shards is not None else ():
            self.shards.update(program.shards)
            self.whole.update((n, s) for b in program.param_buckets for n, s in zip(b.names, b.shapes))
        runners = runners_for(programs, compile=self.execution.compile, cuda_graph=self.execution.cuda_graph)
        return Built(programs, state, plan, self._setup(batch, programs), runners, outer=outer_plan)

    def _cost_model(self, batch: tuple) -> CostModel | None:
        """The cost model of this batch shape, measured once on the step's group where a pass asks for one
        (``bucket_cap_mb="auto"``); a retrace (model mode, new state) reuses it."""
        wanted = any(getattr(p, "wants_cost_model", False) for p in self.strategy.passes())
        if not (wanted and self.placement.live and self.placement.world_size > 1):
            return None
        key = batch_key(batch)
        if key not in self.measured:
            self.measured[key] = cost_probe.measure(self.model, self.loss_fn, batch, self.placement.group_name)
        return self.measured[key]

    def _link_cost(self) -> LinkCost | None:
        """What an all-gather costs on the step's group, where a pass asks (zero3's ``bucket_cap_mb="cost"``)."""
        wanted = any(getattr(p, "wants_link_cost", False) for p in self.strategy.passes())
        if not (wanted and self.placement.live and self.placement.world_size > 1):
            return None
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return cost_probe.measure_link(device, self.placement.group_name, self.placement.world_size)

    def _setup(self, batch: tuple, programs: dict[str, StepProgram]) -> Setup:
        """What every rank compares before these programs first run (``handshake.py``)."""
        placement, outer = self.placement, self.outer
        members, alone = world_groups(self.subgroups, placement)
        if self.stage is not None:  # the pipeline's collectives are with the other stages, not with these peers
            alone |= {self.stage.group_name}
        if tensor_parallel_of(self.model) is not None:  # each rank's 'tp' collectives, matched across 'dp'
            members["tp"] = tuple(range(placement.world_size))
        return Setup(
            world_size=placement.world_size,
            mode=self.strategy.specs(),
            schedule=self.plan.schedule.settings(),
            timeout_s=placement.timeout.total_seconds(),
            **describe_model(self.model, self.whole),
            optimizer=describe_optimizer(self.optimizer)
            | ({f"outer {k}": v for k, v in describe_optimizer(outer).items()} if outer is not None else {}),
            batch=tuple(str(t.dtype).removeprefix("torch.") for t in batch),
            communication={v: communication_plan(p.graph, alone) for v, p in programs.items()},
            groups=members,
            sources={name: digest for p in programs.values() for name, digest in p.sources.items()},
            compiled=self.execution.compile,
            shards={name: span for p in programs.values() for name, span in p.shards.items()},
            shard_place=shard_place(next(iter(programs.values()))),
        )


def world_groups(
    subgroups: dict[tuple[int, ...], str], placement: Placement
) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """The groups whose collectives the world's ranks must match (name -> ranks), and those each rank is alone
    in, which have nothing to match among them (each rank's torchft group, seen from inside its replica group)."""
    alone = frozenset(name for ranks, name in subgroups.items() if len(ranks) == 1)
    members = {name: ranks for ranks, name in subgroups.items() if name not in alone}
    return members | {placement.group_name: tuple(range(placement.world_size))}, alone


def updates_of(schedule: Schedule, count: int) -> list[str]:
    """The variants a fresh schedule runs at its first ``count`` updates (accumulation micro-steps left out)."""
    out: list[str] = []
    while len(out) < count:
        variant = schedule.variant()
        schedule.observe(variant, {}, 0.0)
        if variant != ACCUMULATE:
            out.append(variant)
    return out


def check_frozen_whole(model: torch.nn.Module, whole: dict[str, tuple[int, ...]]) -> None:
    """A parameter ZeRO-3 holds as a slice cannot become frozen: frozen parameters are whole on every rank."""
    for name, p in model.named_parameters():
        if not p.requires_grad and name in whole and tuple(p.shape) != whole[name]:
            raise ConfigurationError(
                f"parameter '{name}' was frozen (requires_grad=False) after zero3 sharded it: this rank holds only "
                f"its slice {list(p.shape)} of {list(whole[name])}, and a frozen parameter is used whole. Freeze "
                "parameters before the first step, or inside `with step.gathered():` set requires_grad and call "
                "transpile() again."
            )


def runners_for(programs: dict[str, StepProgram], *, compile: bool, cuda_graph: bool) -> dict[str, Callable]:
    """What runs each variant: compiled, captured (one memory pool for all variants), both (the captured device
    part compiled), or its graph module with its ops called directly, and on a GPU with casting copies fused and
    constants folded too (``plain_runner``)."""
    if cuda_graph:
        pool = cuda_graph_module.CAPTURER.new_pool()
        wrap = CompiledProgram if compile else None
        return {v: CapturedProgram(p, v, pool, wrap, cuda_graph_module.CAPTURER) for v, p in programs.items()}
    if compile:
        return {v: CompiledProgram(p.graph_module, v) for v, p in programs.items()}
    return {v: PlainRunner(p.graph_module, fold=runs_on_gpu(p.graph_module)) for v, p in programs.items()}


def fit_budget(traced: StepProgram, variants: dict[str, list[Pass]], execution: Execution) -> None:
    """Where the execution settings give a memory budget, run the ``recompute`` pass on the traced step, once,
    before any variant's pipeline distributes it: every variant and every rank starts from the same choice
    (``passes/recompute.py``). The scratch of the step's ops, which that choice weighs, is measured first, also for
    a pipeline that names the pass itself."""
    budget = execution.memory_budget is not None or execution.memory_budget_bytes is not None
    named = any(p.name == "recompute" for passes in variants.values() for p in passes)
    if budget and named:
        raise ConfigurationError(
            "the pipeline has its own 'recompute' pass and Execution gives a memory budget too: keep one of them."
        )
    if budget or named:
        traced.op_scratch = op_scratch.measure(traced.graph)
    if budget:
        fraction, size = execution.memory_budget, execution.memory_budget_bytes
        fit = PASSES["recompute"](memory_budget=fraction or 0.0, memory_budget_bytes=size or 0)
        traced.own_graphs()  # a reused trace's graphs are the cache's (StepProgram.sharing_graphs)
        Pipeline([fit], list(DEFAULT_VERIFIERS), verify=execution.verify, on_pass=execution.on_pass).run(traced)


def microbatch_of(batch: tuple, microbatches: int) -> tuple:
    """The first of ``microbatches`` equal parts of each tensor of ``batch`` along dim 0 (a pipeline traces one);
    an error for a batch that does not cut into equal parts."""
    if not all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % microbatches == 0 for t in batch):
        shapes = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in batch]
        raise ConfigurationError(
            f"a pipeline cuts every tensor of the batch into {microbatches} equal microbatches along dim 0; the "
            f"batch's shapes are {shapes}. Make the batch size a multiple of {microbatches}."
        )
    return tuple(t.tensor_split(microbatches)[0] for t in batch)


def split_stage(
    traced: StepProgram, pipeline: PipelineParallel, stage: Axis, execution: Execution, points: tuple[str, ...]
) -> None:
    """Cut this rank's stage out of the step traced on one microbatch (``passes/split_stages.py``), before any
    mode's passes: they see one stage's program, its gradients the means over the microbatches. Traced at
    ``points``: the user's split points, or every block as a candidate, of which the pass's balanced cut keeps
    one per chunk after the first (``passes/stage_balance.py``)."""
    if execution.memory_budget is not None or execution.memory_budget_bytes is not None:
        raise ConfigurationError("a memory budget with a pipeline is not supported yet; leave memory_budget out.")
    split = PASSES["split-stages"](
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        virtual=pipeline.virtual_stages,
        candidates="" if pipeline.split_points else ",".join(points),
    )
    traced.axes = {"pp": stage}
    Pipeline([split], list(DEFAULT_VERIFIERS), verify=execution.verify, on_pass=execution.on_pass).run(traced)
    traced.axes = {}


def rewrite(
    traced: StepProgram,
    passes: list[Pass],
    placement: Placement,
    *,
    verify: bool = True,
    on_pass: Callable[[str, StepProgram], None] | None = None,
    subgroups: dict[tuple[int, ...], str] | None = None,
    axes: Axes = (),
) -> StepProgram:
    """Run the pipeline on a copy of ``traced`` for ``placement``'s rank. ``axes`` gives each rank's groups of a
    2-D layout (``program.axes``; none: one dimension). Without a live world (``transpiler dump``, a step built
    ahead), it also builds the other ranks' programs, history-free, and checks that all ranks agree; in a live
    world the ranks check the same at the startup handshake (``runtime/handshake.py``) on the programs they
    actually built, so each rank runs the pipeline once, not W times. A live rank keeps no history either (the
    code after each pass, for ``transpiler dump`` and a ``StaticWorld`` build; ``Execution(on_pass=...)`` sees
    each pass live)."""
    subgroups = dict(subgroups or {})

    def for_rank(r: int, callback=None, history: bool = True) -> StepProgram:
        program = traced.clone(rank=r)
        program.world_size, program.group_name = placement.world_size, placement.group_name
        program.subgroups = dict(subgroups)
        program.axes = {
            name: Axis(len(ranks), ranks.index(r), subgroups[ranks])
            for name, ranks in (axes[r] if axes else {}).items()
        }
        verifiers = list(DEFAULT_VERIFIERS)
        Pipeline(passes, verifiers, verify=verify, on_pass=callback, keep_history=history).run(program)
        return program

    mine = for_rank(placement.rank, on_pass, history=not placement.live)
    if verify:
        check_output_shapes(mine)
    if verify and placement.world_size > 1 and not placement.live:
        w = placement.world_size
        ranks = range(w) if w <= CROSS_RANK_LIMIT else sorted({0, 1, w - 1})
        others = [mine if r == placement.rank else for_rank(r, history=False) for r in ranks]
        if subgroups and w <= CROSS_RANK_LIMIT:  # subgroups or point-to-point: simulate every rank's sequence
            check_communication(others, *world_groups(subgroups, placement))
        else:
            check_cross_rank(others)
        if len(others) == w:
            check_shards(others)
    log.debug(
        "pipeline %s built for rank %d of %d", ",".join(p.spec() for p in passes), placement.rank, placement.world_size
    )
    return mine
