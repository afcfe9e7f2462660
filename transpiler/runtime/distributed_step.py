"""Runs a rank's step programs and keeps the model and optimizer up to date: the run loop, and the step's public
face.

The runtime owns no training state of the model's: parameters and buffers live in the user's model, optimizer
state in ``optimizer.state``. Each call feeds them to the graph and writes the graph's results back; state that
passes add (LocalSGD snapshots, say) lives in the step's ``extra`` and travels in :meth:`state_dict`. Each of
the step's jobs has its own module, all sharing one record (``step_state.StepState``): the program cache and
retracing (``program_cache.py``), the ports (``feed.py``), what runs before a program first runs
(``startup.py``), ZeRO-3's lent parameters (``lending.py``), DiLoCo's global weights (``global_weights.py``),
snapshots (``snapshots.py``), DCP checkpoints (``dcp_checkpoint.py``) and the memory report. A call enters this
module twice, at :meth:`__call__` and at the run loop it wraps; everything else here is a one-line delegation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from transpiler.errors import ConfigurationError
from transpiler.graph.memory import MemoryEstimate, memory_estimate
from transpiler.graph.program import StepProgram
from transpiler.strategies.schedules import EveryStep, Schedule
from transpiler.trace.environment import AutocastState, running_environment

from . import dcp_checkpoint, feed, global_weights, lending, op_scratch, snapshots
from .data_position import DataPosition
from .failures import run_named
from .memory_report import LastRun, MemoryReport, memory_report
from .plain_runner import PlainRunner
from .process_group import Placement
from .program_cache import Builder, Built, ProgramCache
from .quorum import Quorum
from .sharded_params import LentParameters
from .startup import Startup
from .step_state import StepState


class DistributedStep:
    """One training step per call on this rank's batch shard; returns this rank's loss."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Any,
        placement: Placement,
        build: Builder,
        schedule: Schedule | None = None,
        *,
        mode_specs: dict[str, str] | None = None,
        max_cached_programs: int = 8,
        observers: list[Callable[[torch.nn.Module, str], None]] | None = None,
        replicated: bool = False,
        outer_optimizer: torch.optim.Optimizer | None = None,
        replica_ranks: tuple[int, ...] = (),
        holds_param_slices: bool = False,
        quorum: Quorum | None = None,
    ):
        self._state = StepState(
            model=model,
            optimizer=optimizer,
            outer_optimizer=outer_optimizer,
            placement=placement,
            schedule=schedule if schedule is not None else EveryStep(),
            mode_specs=dict(mode_specs or {}),
            replicated=replicated,
            replica_ranks=replica_ranks or (placement.rank,),
            holds_param_slices=holds_param_slices,
        )
        # the same objects as the record's, for the user
        self.model, self.optimizer, self.outer_optimizer = model, optimizer, outer_optimizer
        self.loss_fn, self.placement, self.schedule = loss_fn, placement, self._state.schedule
        self.mode_specs, self.replicated = self._state.mode_specs, replicated
        self.replica_ranks = self._state.replica_ranks
        self.observers = list(observers or [])  # called after every step with (model, variant): trajectories
        self.last_variant: str | None = None
        self.last_metrics: dict[str, float] = {}
        self._cache = ProgramCache(build, loss_fn, max_cached_programs)
        self._startup = Startup(placement)
        self._lent = LentParameters(model, placement)
        self._last_run: LastRun | None = None
        self.quorum = quorum  # fault_tolerance: this replica group's seat in a torchft quorum
        self.committed = True  # whether the last call's update was kept (under a quorum, whether it committed)
        self._position: DataPosition | None = None  # the data a quorum's steps take, healed with the step
        if quorum is not None:
            quorum.serve(self._healing_state, self._heal)

    # ------------------------------------------------------------ inspection
    @property
    def extra(self) -> dict[str, torch.Tensor]:
        """State the passes added (snapshots, residuals, the loss scale, θ_global), by name."""
        return self._state.extra

    @property
    def traces(self) -> int:
        """How many times the step was traced (each new batch shape, set of module modes, ...)."""
        return self._cache.traces

    @property
    def programs(self) -> dict[str, StepProgram]:
        """The rank's program per variant (``"step"``, or LocalSGD's ``"local"`` and ``"sync"``)."""
        return self._state.last().programs

    @property
    def program(self) -> StepProgram:
        """The program of the variant that runs most often (``step``, else the last one listed)."""
        return self._state.last().main

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten torch.fx.GraphModule this rank runs (see ``programs`` for multi-variant modes)."""
        return self.program.graph_module

    @property
    def compile_seconds(self) -> dict[str, float]:
        """With ``compile=True``: per variant, how long its first call took, compiling included."""
        runners = self._state.built.runners if self._state.built is not None else {}
        return {v: r.seconds for v, r in runners.items() if getattr(r, "seconds", None) is not None}

    @property
    def captures(self) -> dict[str, int]:
        """With ``cuda_graph=True``: per variant, how many times it was captured (again after a state swap)."""
        runners = self._state.built.runners if self._state.built is not None else {}
        return {v: r.captures for v, r in runners.items() if hasattr(r, "captures")}

    def prepare(self, batch: tuple, autocast: AutocastState | None = None) -> Built:
        """The programs for this batch, the model's current modes and structure and the autocast state (the
        caller's unless given), traced once and cached."""
        state = self._state
        state.built = self._cache.prepare(batch, state.model, state.optimizer, state.outer_optimizer, autocast)
        return state.built

    # ------------------------------------------------------------- execution
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        # grad mode as traced, no inference tensors in the state the step creates or writes back, and autocast
        # off (the graph holds the casts the caller's autocast made while tracing)
        autocast = AutocastState.current()
        with running_environment():
            return self._step(batch, autocast)

    def _step(self, batch: tuple, autocast: AutocastState) -> torch.Tensor:
        """The run loop: the programs for this batch, ready to run; this step's variant fed, run, written back."""
        state = self._state
        state.refuse_while_lent("a training step")
        # held while the step writes its state before the program runs: a peer healing from this group copies that
        # state on the quorum's thread meanwhile (runtime/quorum.py)
        writing = self.quorum.state_lock if self.quorum is not None else contextlib.nullcontext()
        with writing:
            built = state.built = self._cache.prepare(
                batch, state.model, state.optimizer, state.outer_optimizer, autocast
            )
            self._startup.ready(state, built)
        if self.quorum is not None:
            self.quorum.join()  # the first call: the quorum, and healing, which may move the schedule
        variant = state.schedule.variant()
        program = built.programs[variant]
        seat = self.quorum.seat_for(program) if self.quorum is not None else None
        # a quorum that healed this group from a peer moved its schedule: the step is the one the peers run (a
        # Streaming DiLoCo group one sync behind syncs their fragment, not the one it retried)
        if seat is not None and state.schedule.variant() != variant:
            variant = state.schedule.variant()
            program = built.programs[variant]
        with writing:
            feed.init_extra(state, built)
            if program.param_buckets:  # ZeRO-3's slices, before a flat shard binds them
                self._lent.hold(program, built.params)
            state.flat.bind(program.flat_buffers, built.params, state.optimizer, state.extra, built.whole)
            inputs = feed.inputs(state, program, built, batch, variant, self.quorum.inputs() if seat else None)
        on_gpu = bool(built.params) and built.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(built.device)
        runner = built.runners[variant]  # the plain runner's own module names its failing node
        named = runner.module if isinstance(runner, PlainRunner) else program.graph_module
        run = functools.partial(run_named, runner, named, inputs, variant, state.placement)
        outputs, self.committed = self.quorum.run(run) if seat is not None else (run(), True)
        if not self.committed:  # the quorum did not commit this step: nothing is written back, it is retried
            return outputs[0] if outputs is not None else torch.tensor(float("nan"))
        if self._position is not None:  # data parallel: the quorum's batches; DiLoCo: this group's own one
            self._position.commit(seat.participants if seat is not None and self.quorum.every_step else 1)
        self._last_run = LastRun.of(program, batch, torch.cuda.max_memory_allocated(built.device) if on_gpu else None)
        metrics = feed.write_back(state, program, built, variant, inputs, outputs)
        state.flat.written(state.optimizer, skipped=metrics.get("overflow", 0.0) != 0.0)
        state.schedule.observe(variant, metrics, float(state.optimizer.param_groups[0]["lr"]))
        self.last_variant, self.last_metrics = variant, metrics
        for observe in self.observers:
            observe(state.model, variant)
        if self.quorum is not None:
            self.quorum.take_next()  # the next step's quorum, while this process goes on
        return outputs[0]

    # ------------------------------------------------------------ the quorum
    def next_batch(self, position: DataPosition) -> torch.Tensor:
        """Under ``fault_tolerance``: this rank's sample indices for the next step in ``position`` (whose
        ``global_batch`` is one group's batch, split among the group's ranks in rank order). The position moves
        only when the step commits, and travels with the state a returning group heals from, so a group that comes
        back resumes where its peers are and ends when they do.

        Data parallel (a quorum every step): this step's quorum first (waited for, and this group healed from a
        peer when it is behind), then this group's share of the participants' samples, so no sample is lost or
        taken twice among committed steps. DiLoCo: each group reads its own order of the data (a ``DataPosition``
        seeded per group); a group's first call joins the quorum, healing a returning group's position (epoch and
        offset, not its seed) with the rest of its state, and later calls take no quorum."""
        if self.quorum is None:
            raise ConfigurationError(
                "next_batch() is for a step under fault_tolerance=; without a quorum use DataPosition.epoch_batches."
            )
        world, rank = self.placement.world_size, self.placement.rank
        if position.global_batch % world:
            raise ConfigurationError(
                f"the group's batch ({position.global_batch} samples: DataPosition's global_batch) must divide among "
                f"its {world} ranks."
            )
        self._position = position
        if self.quorum.every_step:
            seat = self.quorum.begin()
            return position.quorum_part(seat.index, seat.participants).chunk(world)[rank]
        self.quorum.join()
        return position.quorum_part(0, 1).chunk(world)[rank]

    def _healing_state(self) -> dict:
        position = self._position.state_dict() if self._position is not None else None
        return {"step": self.state_dict(), "data": position}

    def _heal(self, state: dict) -> None:
        self.load_state_dict(state["step"])
        if self._position is not None and state["data"] is not None:
            self._position.load_state_dict(state["data"], own_order=not self.quorum.every_step)
        if self.outer_optimizer is not None:
            self._start_round_from_global()

    def _start_round_from_global(self) -> None:
        """DiLoCo, after healing at a sync: the peers are mid-round, each on weights of its own (and torchft picks
        the peer per rank, so the ranks of a group may heal from different peers), but θ_global is the same on
        all of them: the group's weights start from it, as at the start of a round."""
        weights = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self.global_parameters().items():
                weights[name].copy_(value)

    # ------------------------------------------------ lending, memory, global weights
    def gathered(self, writeback: bool = True) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Under ``zero3``, the model with whole parameters inside the block (each rank's slices all-gathered,
        one bucket at a time): evaluate it, save ``model.state_dict()``, or edit parameters. On leaving, every
        rank keeps its slice of what the parameters then hold (``writeback=False``: of what they held before).
        Every rank must enter it, since it all-gathers. In the other modes the parameters are whole already and
        it does nothing. Yields the model."""
        return lending.gathered(self._state, self._lent, writeback, self._startup)

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """DiLoCo's global weights θ_global by parameter name, as the last sync left them (before the first, the
        parameters themselves); the tensors the step holds, not copies. Other modes have none: an error. Under
        Streaming DiLoCo an exchange still in flight is waited for here, and applied by its ``apply`` step as
        usual: θ_global holds it only after that step."""
        return global_weights.global_parameters(self._state)

    def global_weights(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Inside the block the model holds DiLoCo's global weights θ_global (what the paper evaluates): evaluate
        it, or save ``model.state_dict()``. On leaving, each replica's own weights come back; an edit made inside
        is not kept. Yields the model. No communication: every rank holds θ_global."""
        return global_weights.global_weights(self._state)

    def memory_report(self) -> MemoryReport:
        """The bytes this rank holds between steps (parameters, gradients with the accumulators of gradient
        accumulation, optimizer state, transpiler state; each storage once, counted from the tensors held) and
        the peak during the last step (``runtime/memory_report.py``). ``print(step.memory_report())`` shows
        them in MiB."""
        return memory_report(self._state, self._last_run)

    def memory_estimate(self, variant: str | None = None) -> MemoryEstimate:
        """The peak bytes of a step of this rank predicted from its program's schedule, before it runs, by kind
        (``graph/memory.py``): what it holds as inputs, and its own tensors at their peak (activations kept,
        backward temporaries, communication buffers, the update's). Of the variant that runs most often unless
        ``variant`` names another; the programs are those of the example batch given to ``transpile()`` or of
        the last step. ``print(step.memory_estimate())`` shows them in MiB."""
        built = self._state.last()
        if variant is not None and variant not in built.programs:
            raise ConfigurationError(f"no program variant {variant!r}; this step has {sorted(built.programs)}.")
        program = built.programs[variant] if variant else built.main
        program.op_scratch.update(op_scratch.measure(program.graph))
        return memory_estimate(program)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """A snapshot (deep copy) of model, optimizer and transpiler state, for :meth:`load_state_dict`.

        A copy because ``optimizer.state_dict()`` shares its per-parameter dicts
        with the live optimizer, which every step updates. The LR scheduler is
        not included: save ``scheduler.state_dict()`` beside it. Under DiLoCo the
        outer optimizer's state is the entry ``"outer_optimizer"``, and the global
        weights are in the transpiler's ``extra`` state (``global.<param>``). On a
        pipeline it is the rank's stage's: the model entries and optimizer state
        of its parameters and buffers, read back by the same stage.
        """
        return snapshots.state_dict(self._state, self._lent)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` exactly, on this rank, after checking it fits this step.

        Every rank keeps what it loads (no broadcast from rank 0 afterwards), so
        per-rank state such as BatchNorm statistics and LocalSGD's drift
        between syncs comes back as saved.
        """
        snapshots.load_state_dict(self._state, self._lent, state_dict)

    def save_checkpoint(self, path: str | Path) -> None:
        """Write this step's state to the folder ``path`` with ``torch.distributed.checkpoint``; every rank calls
        it. A sharded mode's ranks each write their slices of the optimizer state (and under ``zero3`` of the
        parameters); what is the same on every rank is written once. :meth:`load_checkpoint` reads it back at
        any world size, in any mode that keeps the ranks in step (``allreduce``, ``fused_allreduce``, ``zero1``,
        ``zero2``, ``zero3``), and a plain model and optimizer read it with
        ``get_state_dict``/``dcp.load``/``set_state_dict`` (``docs/checkpoints.md``). Before the first step it runs
        the startup first, as the step would (every rank is here): the checkpoint holds rank 0's weights."""
        self._state.refuse_under_pipeline("save_checkpoint()")
        built = self._state.built
        if built is not None and not self._state.started:
            self._startup.ready(self._state, built)
        dcp_checkpoint.save(self._state, self._lent, path)

    def checkpoint_blocked(self) -> str | None:
        """Why :meth:`save_checkpoint` cannot run now (None: it can): in the middle of an accumulation cycle, or
        with a Streaming DiLoCo exchange in flight. A ``Checkpointer`` saves at the first call that leaves
        neither."""
        return dcp_checkpoint.blocked(self._state)

    def load_checkpoint(self, path: str | Path) -> None:
        """Read a :meth:`save_checkpoint` folder, written at any world size and mode that keeps ranks in step,
        into this step; every rank calls it. Once the step is built (``example_inputs`` or a first step), each
        rank reads only its own slices of a sharded optimizer state; before, it reads whole tensors and cuts
        them at the first step."""
        self._state.refuse_under_pipeline("load_checkpoint()")
        dcp_checkpoint.load(self._state, self._lent, path)
