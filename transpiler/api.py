"""``transpile()``: the one entry point users call."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from transpiler.graph.collectives import communication_plan
from transpiler.graph.cost_model import CostModel
from transpiler.graph.options import parse_options
from transpiler.graph.pipeline import Pipeline
from transpiler.graph.program import Axis, StepProgram
from transpiler.graph.verify import (
    DEFAULT_VERIFIERS,
    check_communication,
    check_cross_rank,
    check_fragments,
    check_output_shapes,
    check_shards,
)
from transpiler.runtime import cost_probe, host_memory
from transpiler.runtime import cuda_graph as cuda_graph_module
from transpiler.runtime.compile import CompiledProgram
from transpiler.runtime.cuda_graph import CapturedProgram
from transpiler.runtime.distributed_step import Built, DistributedStep, batch_key
from transpiler.runtime.handshake import Setup, describe_model, describe_optimizer
from transpiler.runtime.process_group import Placement, as_timeout, resolve_placement, subgroup_names
from transpiler.runtime.trajectory import TRAJECTORY_OPTIONS, TrajectoryWriter
from transpiler.strategies.modes import build_strategy
from transpiler.strategies.schedules import ACCUMULATE
from transpiler.trace.environment import AutocastState
from transpiler.trace.optimizers import as_optimizer
from transpiler.trace.outer import trace_outer_update
from transpiler.trace.tracer import LossFn, trace_step

from .errors import ConfigurationError

log = logging.getLogger("transpiler")
CROSS_RANK_LIMIT = 16  # beyond this many ranks, the static check compares ranks 0, 1 and W-1


def transpile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    mode: str = "fused_allreduce",
    loss_fn: LossFn = None,
    example_inputs: tuple | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    verify: bool = True,
    on_pass: Callable[[str, StepProgram], None] | None = None,
    timeout: timedelta | float | None = None,
    max_cached_programs: int = 8,
    compile: bool = False,
    cuda_graph: bool = False,
    keep_freed_memory: bool = True,
    outer_optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> DistributedStep:
    """Trace one training step and rewrite it into this rank's distributed program.

    ``mode`` is a mode name (``transpiler modes``) or a pipeline spec such as
    ``"scale-loss-grad,fuse-allreduce{bucket-cap-mb=4}"``; ``options`` are the
    mode's options (``bucket_cap_mb=...``). ``example_inputs`` is one batch as
    ``step`` will get it, ``(*model_inputs, target)``; without it the step is
    traced on its first call. ``world_size``/``rank`` build a rank's program
    without a process group, for inspection; under torchrun leave them out.
    ``timeout`` (seconds or a timedelta) bounds every collective of the step
    and the startup handshake; by default the default group's timeout (torch's
    default is 30 minutes). ``max_cached_programs`` bounds the programs kept
    for different batch shapes and model modes. ``save_trajectory=DIR`` and
    ``trajectory_every=m`` (any mode) make rank 0 save the flattened weights
    every m updates, for ``transpiler pca`` (see ``transpiler/runtime/trajectory.py``). ``compile=True`` compiles
    each rewritten program with ``torch.compile`` (Inductor) on its first call (``transpiler/runtime/compile.py``;
    ``step.compile_seconds`` says how long that took). ``cuda_graph=True`` (NCCL, a model on the GPU, SGD,
    Adam or AdamW) captures each program as a CUDA graph after two warm-up steps and replays it every step,
    bitwise the uncaptured step (``transpiler/runtime/cuda_graph.py``); it composes with ``compile=True``.
    ``optimizer`` may be a list of optimizers over disjoint parameters (Muon for the matrices, AdamW for the
    rest): they are stepped as one (``trace/optimizers/chain.py``). On the CPU, ``keep_freed_memory=True`` has
    glibc keep the memory a step frees for the next step, sized by what the step holds at once, as the CUDA caching
    allocator does, instead of faulting it in again every step (process-wide; ``transpiler/runtime/host_memory.py``,
    the choice is in ``step.program.decisions``).
    ``outer_optimizer`` (``mode="diloco"`` only) is DiLoCo's outer optimizer, any ``torch.optim.Optimizer`` built
    over the same parameters; by default ``SGD(lr=0.7, momentum=0.9, nesterov=True)``, the paper's
    (docs/strategies/diloco.md).
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    optimizer = as_optimizer(optimizer)
    for flag, value in (("compile", compile), ("cuda_graph", cuda_graph), ("keep_freed_memory", keep_freed_memory)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"{flag} must be True or False, got {value!r}.")
    if isinstance(max_cached_programs, bool) or not isinstance(max_cached_programs, int) or max_cached_programs < 1:
        raise ConfigurationError(f"max_cached_programs must be an int >= 1, got {max_cached_programs!r}.")
    saving = parse_options(
        TRAJECTORY_OPTIONS, {k: options.pop(k) for k in list(options) if k in TRAJECTORY_OPTIONS}, "transpile()"
    )
    if "trajectory_every" in saving and not saving.get("save_trajectory"):
        raise ConfigurationError("trajectory_every only applies with save_trajectory=DIR; give both or neither.")
    strategy = build_strategy(mode, options)
    strategy.check(optimizer)
    outer = outer_for(strategy.outer, outer_optimizer, optimizer, mode)
    placement = resolve_placement(world_size, rank, as_timeout(timeout))
    if cuda_graph and outer is not None:
        raise ConfigurationError(
            f"cuda_graph=True is not built for mode '{mode}': its programs hand an exchange in flight from one to "
            "the next, and the outer step's writes to the global weights are not checked under capture. Leave "
            "cuda_graph off (compile=True works)."
        )
    if cuda_graph:
        cuda_graph_module.check_capturable_setup(model, optimizer, placement)
    observers = []
    if saving.get("save_trajectory") and placement.rank == 0:
        observers.append(TrajectoryWriter(Path(saving["save_trajectory"]), saving.get("trajectory_every", 1)))
    subgroups = subgroup_names(placement, strategy.groups(placement.world_size))
    specs = {variant: ",".join(p.spec() for p in passes) for variant, passes in strategy.variants.items()}
    schedule = strategy.schedule()
    wants_cost_model = any(getattr(p, "wants_cost_model", False) for ps in strategy.variants.values() for p in ps)
    measured: dict[tuple, CostModel] = {}  # per batch shape: a retrace (model mode, new state) reuses it
    # a sharded mode's slices of this rank, learnt from its first program: its optimizer state is held that way
    sharded = any(p.shards_state for passes in strategy.variants.values() for p in passes)
    shards: dict[str, tuple[int, int]] | None = {} if sharded else None
    whole: dict[str, tuple[int, ...]] = {}  # ZeRO-3: the whole shape of each parameter held as a slice

    def build(batch: tuple, autocast: AutocastState) -> Built:
        check_frozen_whole(model, whole)
        traced, state, plan = trace_step(model, optimizer, loss_fn, batch, autocast, shards=shards, whole_shapes=whole)
        outer_plan = None
        if outer is not None:
            traced.outer_update, outer_plan = trace_outer_update(outer, state)
        if placement.live and placement.world_size > 1 and wants_cost_model:
            key = batch_key(batch)
            if key not in measured:
                measured[key] = cost_probe.measure(model, loss_fn, batch, placement.group_name)
            traced.cost_model = measured[key]
        programs = {
            variant: rewrite(
                traced, passes, placement, verify=verify, on_pass=on_pass, subgroups=subgroups, axes=strategy.axes
            )
            for variant, passes in strategy.variants.items()
        }
        if outer is not None and verify:
            every = schedule.settings()["sync_every"]
            check_fragments(programs, updates_of(strategy.schedule(), 3 * every), every)
        if keep_freed_memory and host_memory.runs_on_cpu(programs.values()):
            kept = host_memory.keep_freed_memory(programs.values())
            for program in programs.values():
                program.decisions["keep-freed-memory"] = kept
        for program in programs.values() if shards is not None else ():
            shards.update(program.shards)
            whole.update((n, s) for bucket in program.param_buckets for n, s in zip(bucket.names, bucket.shapes))
        setup = Setup(
            world_size=placement.world_size,
            mode=specs,
            schedule=schedule.settings(),
            timeout_s=placement.timeout.total_seconds(),
            **describe_model(model, whole),
            optimizer=describe_optimizer(optimizer)
            | ({f"outer {k}": v for k, v in describe_optimizer(outer).items()} if outer is not None else {}),
            batch=tuple(str(t.dtype).removeprefix("torch.") for t in batch),
            communication={v: communication_plan(p.graph) for v, p in programs.items()},
            groups={name: ranks for ranks, name in subgroups.items()}
            | {placement.group_name: tuple(range(placement.world_size))},
            sources={name: digest for p in programs.values() for name, digest in p.sources.items()},
            compiled=compile,
        )
        runners = runners_for(programs, compile=compile, cuda_graph=cuda_graph)
        return Built(programs, state, plan, setup, runners, outer=outer_plan)

    step = DistributedStep(
        model,
        optimizer,
        loss_fn,
        placement,
        build,
        schedule,
        mode_specs=specs,
        max_cached_programs=max_cached_programs,
        observers=observers,
        replicated=strategy.replicated,
        outer_optimizer=outer,
        replica_ranks=strategy.axes(placement.world_size, placement.rank).get("replica", (placement.rank,)),
    )
    if example_inputs is not None:
        step.prepare(tuple(example_inputs))
    return step


def outer_for(
    check: Callable[[torch.optim.Optimizer], None] | None,
    given: torch.optim.Optimizer | None,
    inner: torch.optim.Optimizer,
    mode: str,
) -> torch.optim.Optimizer | None:
    """The outer optimizer of a mode that has one (DiLoCo's; the paper's Nesterov SGD when none is given), checked
    to be over the inner optimizer's parameters; an error for one given to another mode."""
    if check is None:
        if given is not None:
            raise ConfigurationError(
                f"outer_optimizer only applies to modes 'diloco' and 'streaming_diloco'; mode '{mode}' has no outer "
                "step. Drop it, or use one of those."
            )
        return None
    params = [p for group in inner.param_groups for p in group["params"]]
    if given is None:
        return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    check(given)
    if not isinstance(given, torch.optim.Optimizer):
        raise ConfigurationError(f"outer_optimizer must be a torch.optim.Optimizer, got {type(given).__name__}.")
    outer_params = [p for group in given.param_groups for p in group["params"]]
    if {id(p) for p in outer_params} != {id(p) for p in params}:
        raise ConfigurationError(
            "outer_optimizer must be built over the same parameters as the inner optimizer (DiLoCo's outer step "
            f"updates the global copy of each one): it holds {len(outer_params)} tensors, the inner optimizer "
            f"{len(params)}, and they differ. Build it with model.parameters(), as the inner one."
        )
    return given


def updates_of(schedule: Any, count: int) -> list[str]:
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
    """What runs each variant other than its graph module: compiled, captured (one memory pool for all
    variants), or both (the captured device part compiled)."""
    if cuda_graph:
        pool = cuda_graph_module.CAPTURER.new_pool()
        wrap = CompiledProgram if compile else None
        return {v: CapturedProgram(p, v, pool, wrap, cuda_graph_module.CAPTURER) for v, p in programs.items()}
    return {v: CompiledProgram(p.graph_module, v) for v, p in programs.items()} if compile else {}


def rewrite(
    traced: StepProgram,
    passes: list,
    placement: Placement,
    *,
    verify: bool = True,
    on_pass=None,
    subgroups: dict[tuple[int, ...], str] | None = None,
    axes: Callable[[int, int], dict[str, tuple[int, ...]]] = lambda world, rank: {},
) -> StepProgram:
    """Run the pipeline on a copy of ``traced`` for ``placement``'s rank, checking all ranks agree. ``axes`` gives
    a 2-D layout's groups of each rank (``program.axes``)."""

    def for_rank(r: int, callback=None) -> StepProgram:
        program = traced.clone(rank=r)
        program.world_size, program.group_name = placement.world_size, placement.group_name
        program.subgroups = dict(subgroups or {})
        program.axes = {
            name: Axis(len(ranks), ranks.index(r), program.subgroups[ranks])
            for name, ranks in axes(placement.world_size, r).items()
        }
        Pipeline(passes, list(DEFAULT_VERIFIERS), verify=verify, on_pass=callback).run(program)
        return program

    mine = for_rank(placement.rank, on_pass)
    if verify:
        check_output_shapes(mine)
    if verify and placement.world_size > 1:
        w = placement.world_size
        ranks = range(w) if w <= CROSS_RANK_LIMIT else sorted({0, 1, w - 1})
        others = [mine if r == placement.rank else for_rank(r) for r in ranks]
        if subgroups and w <= CROSS_RANK_LIMIT:  # subgroups or point-to-point: simulate every rank's sequence
            check_communication(
                others, {name: ranks for ranks, name in subgroups.items()} | {placement.group_name: tuple(range(w))}
            )
        else:
            check_cross_rank(others)
        if len(others) == w:
            check_shards(others)
    log.debug(
        "pipeline %s built for rank %d of %d", ",".join(p.spec() for p in passes), placement.rank, placement.world_size
    )
    return mine
