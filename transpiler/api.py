"""``transpile()``: the one entry point users call. It reads as the pipeline it runs: check what it was given,
place this rank, build the mode's strategy for what the step runs in, and hand the step a builder that traces and
rewrites on its first batch (or now, given ``example_inputs``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from transpiler.graph.program import Axis
from transpiler.runtime import cuda_graph as cuda_graph_module
from transpiler.runtime.distributed_step import DistributedStep
from transpiler.runtime.execution import Execution
from transpiler.runtime.fault_tolerance import FaultTolerance
from transpiler.runtime.process_group import (
    Placement,
    StaticWorld,
    mesh_placement,
    pipeline_mesh_placement,
    pipeline_placement,
    resolve_placement,
    subgroup_names,
)
from transpiler.runtime.quorum import InspectedQuorum, Quorum
from transpiler.runtime.trajectory import TrajectoryWriter
from transpiler.strategies.mode_config import ModeConfig, Surroundings
from transpiler.strategies.modes import as_config
from transpiler.strategies.pipeline_parallel import PipelineParallel
from transpiler.strategies.strategy import Strategy
from transpiler.trace.environment import AutocastState
from transpiler.trace.optimizers import as_optimizer
from transpiler.trace.signature import StepTrace
from transpiler.trace.tensor_parallel import has_dtensor_parameters, localize, tensor_parallel_of
from transpiler.trace.trace_cache import TraceCache
from transpiler.trace.tracer import LossFn, trace_step

from .build import StepBuilder
from .deprecated import keywords_of_before
from .errors import ConfigurationError

Mesh = DeviceMesh | StaticWorld


@runtime_checkable
class Planned(Protocol):
    """A plan's pick (``transpiler.planner``'s ``Candidate``) given as ``transpile()``'s config: it sets the mode's
    config, the pipeline, the execution flags it was priced with and the mesh a pipeline with replicas needs."""

    def transpile_arguments(
        self, execution: Execution | None, mesh: Mesh | None, pipeline: PipelineParallel | None
    ) -> tuple[ModeConfig, Execution, Mesh | None, PipelineParallel | None]: ...


def transpile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: ModeConfig | Planned | str = "fused_allreduce",
    loss_fn: LossFn = None,
    example_inputs: tuple | None = None,
    *,
    mesh: Mesh | None = None,
    fault_tolerance: FaultTolerance | None = None,
    execution: Execution | None = None,
    trace: StepTrace | TraceCache | None = None,
    outer_optimizer: torch.optim.Optimizer | None = None,
    pipeline: PipelineParallel | None = None,
    **deprecated: Any,
) -> DistributedStep:
    """Trace one training step and rewrite it into this rank's distributed program.

    ``config``: a mode's config (``ZeRO(stage=3)``, ``DiLoCo(sync_every=50)``...; ``transpiler modes``), a mode's
    name for its defaults (``"zero3"``), ``PassPipeline(spec)``, or a plan's pick (``plan(...).best``: its config,
    pipeline and flags; ``execution`` keeps its other settings). ``loss_fn(model(*batch[:-1]), batch[-1])`` is the
    loss, else the model's output is. ``example_inputs``: one batch as ``step`` gets it (else traced on the first
    call). ``optimizer``: one, or a list over disjoint parameters stepped as one (``trace/optimizers/chain.py``).

    ``mesh``: the 1-D device mesh the mode spans (``mesh["dp"]`` of a ``("dp", "tp")`` mesh), for a model under
    torch's tensor-parallel plan, traced through DTensor (each rank's programs, model and optimizer hold its shards
    from here on: docs/strategies/tensor_parallel.md); or ``StaticWorld(size, rank)`` to build a rank's programs
    without a process group, for inspection. ``fault_tolerance=FaultTolerance(...)`` runs this torchrun job as one
    replica group under a torchft quorum (docs/fault_tolerance.md). ``execution=Execution(...)``: compiled or
    captured, the timeout, the program cache, host memory, verification, weight trajectories. ``trace``: the step
    traced ahead by :func:`trace_training_step` (checked to be this step's; a ``TraceMismatchError`` names the
    first difference), or a :class:`TraceCache` that serves every build. ``outer_optimizer``: the outer optimizer
    of ``DiLoCo`` and ``StreamingDiLoCo`` (the paper's Nesterov SGD at lr 0.7 by default), over the same parameters.
    ``pipeline=PipelineParallel(...)``: each rank runs one stage; ``mesh`` names ``pp`` and ``dp`` (the mode's), as
    ``mesh["pp", "dp"]`` beside a plan on ``mesh["tp"]``. ``mode=``... (before issue 73) warn ``RenamedWarning``.
    """
    config, execution, mesh = keywords_of_before(config, execution, mesh, deprecated)
    config, execution, mesh, pipeline = planned_arguments(config, execution, mesh, pipeline)
    optimizer, config = checked_arguments(model, optimizer, fault_tolerance, trace), as_config(config)
    planned = tensor_parallel_planned(model, mesh, pipeline)
    placement, stage = place(mesh, execution, planned, pipeline, trace, fault_tolerance)
    strategy = config.strategy(surroundings(planned, placement, fault_tolerance, execution, pipeline))
    strategy.check(optimizer)
    outer = outer_for(strategy, outer_optimizer, optimizer, config.mode)
    quorum, seats, placement = seat(fault_tolerance, strategy, placement, mesh, example_inputs, config.mode)
    if planned:  # every check passed: the model and optimizers hold their shards from here on
        localize(model, [optimizer] + ([outer] if outer is not None else []))
    if execution.cuda_graph:
        cuda_graph_module.check_capturable_setup(model, optimizer, placement)
    plan = strategy.for_rank(placement.world_size, placement.rank)
    across = seats.across(plan.axes) if seats is not None else {}  # a group of several ranks: torchft's group
    subgroups = subgroup_names(placement, [g for g in plan.groups if g not in across]) | across
    builder = StepBuilder(
        model, optimizer, loss_fn, outer, strategy, plan, placement, subgroups, execution, trace, pipeline, stage
    )
    step = DistributedStep(
        model,
        optimizer,
        loss_fn,
        placement,
        builder,
        plan.schedule,
        mode_specs=strategy.specs(),
        max_cached_programs=execution.max_cached_programs,
        observers=trajectory_writers(execution, placement),
        replicated=strategy.replicated,
        outer_optimizer=outer,
        replica_ranks=plan.replica_ranks,
        holds_param_slices=any(p.shards_params for p in strategy.passes()),
        quorum=quorum,
    )
    if example_inputs is not None:
        step.prepare(tuple(example_inputs))
    return step


def surroundings(
    planned: bool,
    placement: Placement,
    fault_tolerance: FaultTolerance | None,
    execution: Execution,
    pipeline: PipelineParallel | None,
) -> Surroundings:
    """What the mode's config is built into: a tensor-parallel plan, a quorum, compiled or captured, a pipeline."""
    return Surroundings(
        tensor_parallel=planned,
        quorum_group=placement.world_size if fault_tolerance is not None else None,
        async_quorum=fault_tolerance is not None and fault_tolerance.async_quorum,
        cuda_graph=execution.cuda_graph,
        compiled=execution.compile,
        pipeline=pipeline is not None,
    )


def planned_arguments(
    config: ModeConfig | Planned | str, execution: Execution | None, mesh: Mesh | None, pipeline
) -> tuple[ModeConfig | str, Execution | None, Mesh | None, PipelineParallel | None]:
    """A plan's pick's config, execution, mesh and pipeline (``Planned``); the arguments as given otherwise."""
    if isinstance(config, Planned):
        return config.transpile_arguments(execution, mesh, pipeline)
    return config, execution, mesh, pipeline


def checked_arguments(
    model: object, optimizer: object, fault_tolerance: object, trace: object
) -> torch.optim.Optimizer:
    """The optimizer as one (a chain of several); an error for an argument of the wrong kind."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
        raise ConfigurationError(
            f"fault_tolerance must be a transpiler.FaultTolerance, got {type(fault_tolerance).__name__}."
        )
    if trace is not None and not isinstance(trace, (StepTrace, TraceCache)):
        raise ConfigurationError(
            "trace must be what transpiler.trace_training_step() returns, or a transpiler.TraceCache; got "
            f"{type(trace).__name__}."
        )
    return as_optimizer(optimizer)


def tensor_parallel_planned(model: torch.nn.Module, mesh: Mesh | None, pipeline: PipelineParallel | None) -> bool:
    """Whether the model is under torch's tensor-parallel plan (its parameters DTensors, or localized already; a
    device mesh without a pipeline says so too)."""
    meshed = pipeline is None and mesh is not None and not isinstance(mesh, StaticWorld)
    return meshed or has_dtensor_parameters(model) or tensor_parallel_of(model) is not None


def place(
    mesh: Mesh | None,
    execution: Execution,
    planned: bool,
    pipeline: PipelineParallel | None = None,
    trace: object = None,
    fault_tolerance: FaultTolerance | None = None,
) -> tuple[Placement, Axis | None]:
    """This rank's place: across a device mesh's dimension (a tensor-parallel plan), a static world, or the
    process group torch.distributed was given (a world of one without one); and its stage of a pipeline."""
    if pipeline is not None:
        return place_pipeline(pipeline, mesh, execution, planned, trace, fault_tolerance)
    return place_mode(mesh, execution, planned), None


def place_mode(mesh: Mesh | None, execution: Execution, planned: bool) -> Placement:
    """The mode's place without a pipeline."""
    if planned:
        return mesh_placement(mesh, execution.timeout_delta)
    if mesh is not None and not isinstance(mesh, StaticWorld):
        raise ConfigurationError(
            f"mesh must be a 1-D torch DeviceMesh (beside a tensor-parallel plan) or a StaticWorld; got "
            f"{type(mesh).__name__}."
        )
    size, rank = (mesh.size, mesh.rank) if mesh is not None else (None, None)
    return resolve_placement(size, rank, execution.timeout_delta)


def place_pipeline(
    pipeline: PipelineParallel,
    mesh: Mesh | None,
    execution: Execution,
    planned: bool,
    trace: object,
    fault_tolerance: FaultTolerance | None,
) -> tuple[Placement, Axis]:
    """Under a pipeline: the mode's placement (across ``dp``, or a world of one) and this rank's stage (``pp``);
    an error for what does not combine with one yet."""
    if not isinstance(pipeline, PipelineParallel):
        raise ConfigurationError(f"pipeline must be a transpiler.PipelineParallel, got {type(pipeline).__name__}.")
    refused = {
        "trace=": trace is not None,
        "fault_tolerance=": fault_tolerance is not None,
    }
    for what, given in refused.items():
        if given:
            raise ConfigurationError(f"a pipeline with {what} is not supported yet.")
    if planned and not isinstance(mesh, DeviceMesh):
        raise ConfigurationError(
            "beside a pipeline and a tensor-parallel plan, give transpile() the pipeline's and the mode's dimensions "
            "of the device mesh: mesh=mesh['pp', 'dp'] of a ('pp', 'dp', 'tp') mesh whose 'tp' the plan spans."
        )
    if isinstance(mesh, DeviceMesh):
        return pipeline_mesh_placement(pipeline.stages, mesh, execution.timeout_delta)
    size, rank = (mesh.size, mesh.rank) if isinstance(mesh, StaticWorld) else (None, None)
    return pipeline_placement(pipeline.stages, size, rank, execution.timeout_delta)


def seat(
    fault_tolerance: FaultTolerance | None,
    strategy: Strategy,
    placement: Placement,
    mesh: Mesh | None,
    example_inputs: tuple | None,
    mode: str,
) -> tuple[Quorum | None, Quorum | InspectedQuorum | None, Placement]:
    """Under a quorum: this replica group's seat in it (None for a program only built to be looked at), where the
    collectives across groups go, and the placement the programs are built for."""
    if fault_tolerance is None:
        return None, None, placement
    seats: Quorum | InspectedQuorum
    quorum = None
    if isinstance(mesh, StaticWorld) and not (dist.is_available() and dist.is_initialized()):  # to be looked at
        seats = InspectedQuorum()
    else:
        if example_inputs is None and any(p.shards_params for p in strategy.passes()):
            raise ConfigurationError(
                f"under fault_tolerance, mode '{mode}' needs example_inputs= (one batch as the step will get it): a "
                "group that starts late or comes back heals each rank's slices of the parameters from a peer at its "
                "first quorum, before its first step, and a rank knows its slices once it is built."
            )
        seats = quorum = Quorum(fault_tolerance, placement, every_step=strategy.outer is None)
    two_level = "across" in strategy.layout.axes(placement.world_size, placement.rank)
    return quorum, seats, seats.placement(placement, two_level)


def trajectory_writers(execution: Execution, placement: Placement) -> list[TrajectoryWriter]:
    """Rank 0's weight-trajectory writer, where the execution settings ask for one."""
    if not execution.save_trajectory or placement.rank != 0:
        return []
    return [TrajectoryWriter(Path(execution.save_trajectory), execution.trajectory_every)]


def trace_training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_fn: LossFn = None,
    example_inputs: tuple = (),
) -> StepTrace:
    """Trace one training step (forward, loss, backward, update) once, for several ``transpile(..., trace=...)``
    calls to share: one model under several modes, or fresh instances of the same model and optimizer (a
    benchmark's sweep, a test's references). Tracing is about half of what building a step costs. The trace is
    taken under the caller's autocast state and holds no tensor of the model; its graph is
    ``trace.program.graph_module``. What the forward reads besides the model's parameters, buffers and attributes
    (a global, say) is not checked: reuse a trace only for the same code."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(example_inputs, (tuple, list)):
        raise ConfigurationError("example_inputs must be one batch as the step will get it: (*model_inputs, target).")
    trace, _, _ = trace_step(model, as_optimizer(optimizer), loss_fn, tuple(example_inputs), AutocastState.current())
    return trace


def outer_for(
    strategy: Strategy, given: torch.optim.Optimizer | None, inner: torch.optim.Optimizer, mode: str
) -> torch.optim.Optimizer | None:
    """The outer optimizer of a mode that has one (DiLoCo's; the paper's Nesterov SGD when none is given), checked
    to be over the inner optimizer's parameters; an error for one given to another mode."""
    if strategy.outer is None:
        if given is not None:
            raise ConfigurationError(
                f"outer_optimizer only applies to modes 'diloco' and 'streaming_diloco'; mode '{mode}' has no outer "
                "step. Drop it, or use one of those."
            )
        return None
    params = [p for group in inner.param_groups for p in group["params"]]
    if given is None:
        return strategy.outer_sgd.build(params)
    if strategy.outer_sgd.fixed:
        raise ConfigurationError(
            f"mode '{mode}' takes no outer_optimizer: its outer step is its own formula, θ_global − outer_lr × "
            "the mean of what the replicas sent, with no momentum (the error buffers play its part). Set "
            "outer_lr=..., and drop outer_optimizer."
        )
    strategy.check_outer(given)
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
