"""``transpile()``: the one entry point users call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from transpiler.graph.options import parse_options
from transpiler.graph.program import StepProgram
from transpiler.runtime import cuda_graph as cuda_graph_module
from transpiler.runtime.distributed_step import DistributedStep
from transpiler.runtime.process_group import as_timeout, mesh_placement, resolve_placement, subgroup_names
from transpiler.runtime.quorum import FaultTolerance, InspectedQuorum, Quorum
from transpiler.runtime.trajectory import TRAJECTORY_OPTIONS, TrajectoryWriter
from transpiler.strategies.modes import build_strategy
from transpiler.strategies.quorum import quorum_strategy
from transpiler.strategies.strategy import Strategy
from transpiler.strategies.tensor_parallel import check_tensor_parallel
from transpiler.trace.environment import AutocastState
from transpiler.trace.optimizers import as_optimizer
from transpiler.trace.signature import StepTrace
from transpiler.trace.tensor_parallel import has_dtensor_parameters, localize, tensor_parallel_of
from transpiler.trace.trace_cache import TraceCache
from transpiler.trace.tracer import LossFn, trace_step

from .build import StepBuilder
from .errors import ConfigurationError


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
    fault_tolerance: FaultTolerance | None = None,
    trace: StepTrace | TraceCache | None = None,
    mesh: DeviceMesh | None = None,
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
    ``fault_tolerance=FaultTolerance(lighthouse=..., replica_id=...)`` runs this torchrun job as one replica group
    under a torchft quorum: a lost group costs the others one uncommitted step, not a restart, and a group that
    comes back heals from a live peer (``transpiler/runtime/quorum.py``, docs/fault_tolerance.md). With
    ``world_size``/``rank`` and no process group it builds, for inspection, the program a replica group of
    ``world_size`` ranks runs under a quorum (torchft's group is the label ``quorum`` in its graphs).
    ``trace`` (from :func:`trace_training_step`) is the step traced ahead: the first build copies it instead of
    tracing, after checking that it was made for this model's structure and attributes, this optimizer's class
    and hyper-parameters, this loss and this batch (a ``TraceMismatchError`` names the first difference). A
    :class:`TraceCache` instead serves every build (a new batch shape, eval mode) from the traces it holds, and
    keeps the ones it makes.
    ``mesh`` is the 1-D device mesh the mode spans (``mesh["dp"]`` of a ``("dp", "tp")`` mesh), for a model under
    torch's tensor-parallel plan (``parallelize_module(model, mesh["tp"], plan)``): the step is traced through
    DTensor, each rank's program holds its shards of the parameters (the model and the optimizer hold them from
    here on; calling the model still works), and the mode (``fused_allreduce``, ``zero1/2/3``, ``diloco``,
    ``streaming_diloco``) runs across ``mesh`` (``trace/tensor_parallel.py``, docs/strategies/tensor_parallel.md).
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    optimizer = as_optimizer(optimizer)
    for flag, value in (("compile", compile), ("cuda_graph", cuda_graph), ("keep_freed_memory", keep_freed_memory)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"{flag} must be True or False, got {value!r}.")
    if trace is not None and not isinstance(trace, (StepTrace, TraceCache)):
        raise ConfigurationError(
            "trace must be what transpiler.trace_training_step() returns, or a transpiler.TraceCache; got "
            f"{type(trace).__name__}."
        )
    if isinstance(max_cached_programs, bool) or not isinstance(max_cached_programs, int) or max_cached_programs < 1:
        raise ConfigurationError(f"max_cached_programs must be an int >= 1, got {max_cached_programs!r}.")
    saving = parse_options(
        TRAJECTORY_OPTIONS, {k: options.pop(k) for k in list(options) if k in TRAJECTORY_OPTIONS}, "transpile()"
    )
    if "trajectory_every" in saving and not saving.get("save_trajectory"):
        raise ConfigurationError("trajectory_every only applies with save_trajectory=DIR; give both or neither.")
    planned = mesh is not None or has_dtensor_parameters(model) or tensor_parallel_of(model) is not None
    if planned:
        check_tensor_parallel(
            mode, options, optimizer, fault_tolerance=fault_tolerance is not None, cuda_graph=cuda_graph
        )
        placement = mesh_placement(mesh, world_size, rank, timeout)
    else:
        placement = resolve_placement(world_size, rank, as_timeout(timeout))
    quorum: Quorum | None = None
    seats: Quorum | InspectedQuorum | None = None  # where the collectives across replica groups go
    if fault_tolerance is not None:
        if not isinstance(fault_tolerance, FaultTolerance):
            raise ConfigurationError(
                f"fault_tolerance must be a transpiler.FaultTolerance, got {type(fault_tolerance).__name__}."
            )
        strategy = quorum_strategy(mode, options, placement.world_size, overlap=fault_tolerance.async_quorum)
        if world_size is not None and not (dist.is_available() and dist.is_initialized()):  # to be looked at
            seats = InspectedQuorum()
        else:
            if example_inputs is None and any(p.shards_params for p in strategy.passes()):
                raise ConfigurationError(
                    f"under fault_tolerance, mode '{mode}' needs example_inputs= (one batch as the step will get "
                    "it): a group that starts late or comes back heals each rank's slices of the parameters from a "
                    "peer at its first quorum, before its first step, and a rank knows its slices once it is built."
                )
            seats = quorum = Quorum(fault_tolerance, placement, every_step=strategy.outer is None)
        two_level = "across" in strategy.layout.axes(placement.world_size, placement.rank)
        placement = seats.placement(placement, two_level)
    else:
        strategy = build_strategy(mode, options)
    strategy.check(optimizer)
    outer = outer_for(strategy, outer_optimizer, optimizer, mode)
    if planned:  # every check passed: the model and optimizers hold their shards from here on
        localize(model, [optimizer] + ([outer] if outer is not None else []))
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
    plan = strategy.for_rank(placement.world_size, placement.rank)
    across = seats.across(plan.axes) if seats is not None else {}  # a group of several ranks: torchft's group
    subgroups = subgroup_names(placement, [g for g in plan.groups if g not in across]) | across
    builder = StepBuilder(
        model,
        optimizer,
        loss_fn,
        outer,
        strategy,
        plan,
        placement,
        subgroups,
        verify=verify,
        on_pass=on_pass,
        compile=compile,
        cuda_graph=cuda_graph,
        keep_freed_memory=keep_freed_memory,
        reuse=trace,
    )
    step = DistributedStep(
        model,
        optimizer,
        loss_fn,
        placement,
        builder,
        plan.schedule,
        mode_specs=strategy.specs(),
        max_cached_programs=max_cached_programs,
        observers=observers,
        replicated=strategy.replicated,
        outer_optimizer=outer,
        replica_ranks=plan.replica_ranks,
        holds_param_slices=any(p.shards_params for p in strategy.passes()),
        quorum=quorum,
    )
    if example_inputs is not None:
        step.prepare(tuple(example_inputs))
    return step


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
