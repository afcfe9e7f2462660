"""Runs a rank's step programs and keeps the model and optimizer up to date.

The runtime owns no training state of the model's: parameters and buffers live
in the user's model, optimizer state in ``optimizer.state``. Each call feeds
them to the graph and writes the graph's results back (re-binding ``.data``;
after ``reinplace-optimizer`` the results are the same storage, updated in
place). State that passes add (LocalSGD snapshots, say) lives here, in
``extra``, and travels in :meth:`state_dict`. Inputs and outputs are matched
by their ports, so a pass can add either.

What a program depends on is its cache key: the batch's shapes, which modules
are in training mode, which parameters require grad, the model's parameter
and buffer objects, the optimizer's param groups and the caller's autocast
state. A call whose key is new
traces again (bounded cache, warning when it keeps happening); before a
program with a new setup first runs, the ranks compare setups (handshake.py).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import pickle
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from passes.accumulate_grads import PREFIX as ACCUMULATOR  # zeros after every update: made again
from passes.diloco_outer_step import GLOBAL, OUTER
from passes.loss_scale import SCALE, TRACKER
from passes.shard_params import ShardParams
from transpiler.errors import CheckpointError, ConfigurationError, RetraceWarning
from transpiler.graph.collectives import IN_FLIGHT, WAIT
from transpiler.graph.memory import peak_transient_bytes
from transpiler.graph.program import StepProgram
from transpiler.strategies.schedules import EveryStep, exchange_in_flight
from transpiler.trace.environment import AutocastState, running_environment
from transpiler.trace.optimizers import TWINS, OptimizerPlan
from transpiler.trace.tracer import ModelState, check_batch

from . import sharded_params
from .failures import failures_named, in_graph
from .flat_storage import FlatStorage
from .handshake import Handshake, Setup
from .memory_report import MemoryReport, StorageCounter, bucket_buffers
from .process_group import LOCAL_GROUP, Placement, ensure_local_group, live_group
from .scalar_bank import ScalarBank

if TYPE_CHECKING:
    from .sharded_checkpoint import Ranks

log = logging.getLogger("transpiler")
CHECKPOINT_FORMAT = 2


@dataclass
class Built:
    """Everything traced for one cache key: a program per variant, the model/optimizer layout, the setup."""

    programs: dict[str, StepProgram]
    state: ModelState
    plan: OptimizerPlan
    setup: Setup | None = None  # what the ranks compare before this program first runs
    runners: dict[str, Callable] = field(default_factory=dict)  # variant -> what runs it (compiled, captured)
    scalar_banks: dict[str, ScalarBank] = field(default_factory=dict)  # variant -> its per-step scalar tensors
    outer: OptimizerPlan | None = None  # the outer optimizer's plan (DiLoCo): feeds the ``outer/`` ports
    params: dict[str, torch.nn.Parameter] = field(init=False)  # name maps, made once, read every step
    frozen: dict[str, torch.nn.Parameter] = field(init=False)
    buffers: dict[str, torch.Tensor] = field(init=False)
    positions: dict[str, int] = field(init=False)
    extra_init: dict[str, tuple[str, str]] = field(init=False)  # pass-added state of every variant -> (rule, source)
    whole: dict[str, torch.Size] = field(init=False)  # ZeRO-3: each parameter held as a slice -> its whole shape
    digest: bytes = field(init=False)  # of the setup: equal digests need no new handshake

    def __post_init__(self) -> None:
        self.params = dict(zip(self.state.names, self.state.params))
        self.frozen = dict(zip(self.state.frozen_names, self.state.frozen))
        self.buffers = dict(zip(self.state.buffer_names, self.state.buffers))
        self.positions = {n: i for i, n in enumerate(self.state.names)}
        self.extra_init = {name: rule for p in self.programs.values() for name, rule in p.extra_init.items()}
        self.whole = {
            n: torch.Size(s) for p in self.programs.values() for b in p.param_buckets for n, s in zip(b.names, b.shapes)
        }
        self.runners = {v: self.runners.get(v, p.graph_module) for v, p in self.programs.items()}
        self.digest = hashlib.sha256(pickle.dumps(self.setup)).digest()


Builder = Callable[[tuple, AutocastState], Built]


def initial_extra(rule: str, source: str, params: dict[str, torch.nn.Parameter]) -> torch.Tensor:
    """The first value of pass-added state, by the rule its pass declared in ``program.extra_init``.

    ``copy_param``: a copy of parameter ``source`` (LocalSGD snapshots); ``host_copy_param``: the same in host
    memory (DiLoCo's θ_global offloaded); ``zeros_like_param``: zeros shaped
    as it (accumulators, residuals); ``scalar``: a 0-d tensor from ``"<value>:<dtype>"`` (loss scale);
    ``zeros``: zeros of shape ``"d0,d1,..."``, float32 or the dtype after a colon (``"5:bfloat16"``: sharded
    accumulators); ``eye``: the float32 identity of size ``source`` (DimReduce's curvature state). New tensors
    go where the parameters are.
    """
    if rule == "copy_param":
        return params[source].detach().clone()
    if rule == "host_copy_param":
        return params[source].detach().to("cpu", copy=True)
    if rule == "zeros_like_param":
        return torch.zeros_like(params[source].detach())
    device = next(iter(params.values())).device
    if rule == "scalar":
        value, _, dtype = source.partition(":")
        return torch.tensor(float(value), dtype=getattr(torch, dtype), device=device)
    if rule == "zeros":
        shape, _, dtype = source.partition(":")
        dims = [int(d) for d in shape.split(",") if d]
        return torch.zeros(dims, dtype=getattr(torch, dtype or "float32"), device=device)
    if rule == "eye":
        return torch.eye(int(source), dtype=torch.float32, device=device)
    raise ConfigurationError(f"unknown initialisation rule '{rule}' for extra state.")


def _slice_of(
    plan: OptimizerPlan, position: int, key: str, t: torch.Tensor, bounds: tuple[int, int], shape: torch.Size
) -> torch.Tensor:
    """This rank's slice ``[lo, hi)`` of a parameter's state tensor: cut (and stored in place of the whole
    tensor, which is freed) while it is still shaped as the parameter (``shape``, its whole shape), as it is
    once cut."""
    lo, hi = bounds
    if t.shape == shape:
        piece = t.reshape(-1)[lo:hi]
        if hi - lo == shape.numel():
            return piece
        piece = piece.clone()
        if key in plan.optimizer.state.get(plan.params[position], {}):
            plan.write_back(position, {key: piece})
        return piece
    if t.shape != (hi - lo,):
        raise CheckpointError(
            f"optimizer state '{plan.names[position]}.{key}' has shape {list(t.shape)}; this rank holds elements "
            f"[{lo}, {hi}) of that parameter, or the whole tensor. Was it loaded from a checkpoint of another world "
            "size? step.load_state_dict() reads its own world size only; step.load_checkpoint() reads any."
        )
    return t


REPLICATED_EXTRA = (SCALE, TRACKER)  # pass-added state the same on every rank: a DCP checkpoint saves it once


def _checkpoint_module() -> Any:
    """``runtime/sharded_checkpoint.py``, imported when a DCP checkpoint is written or read, not at start-up:
    it imports ``torch.distributed.checkpoint``, which a step that never checkpoints does not need."""
    from . import sharded_checkpoint

    return sharded_checkpoint


def _replica_checkpoint_module() -> Any:
    """``runtime/replica_checkpoint.py`` (DiLoCo's checkpoints), imported as :func:`_checkpoint_module` is."""
    from . import replica_checkpoint

    return replica_checkpoint


def batch_key(batch: tuple) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in batch)


def structure_key(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, outer: torch.optim.Optimizer | None = None
) -> tuple:
    """What a traced program assumes about the model and the optimizers besides the batch.

    Computed before every step, so in one walk over the modules (each module's
    mode, its own parameters with ``requires_grad``, its own buffers).
    """
    parts: list = []
    for m in model.modules():
        parts.append(m.training)
        parts.extend((id(p), p is not None and p.requires_grad) for p in m._parameters.values())
        parts.extend(id(b) for b in m._buffers.values())
    parts.extend(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)
    for opt in (optimizer, outer) if outer is not None else (optimizer,):
        if type(opt) not in TWINS:  # the generic path's first step creates the state, the second reads it
            parts.append(tuple(bool(opt.state.get(p)) for g in opt.param_groups for p in g["params"]))
    return tuple(parts)


class DistributedStep:
    """One training step per call on this rank's batch shard; returns this rank's loss."""

    def __init__(
        self,
        model,
        optimizer,
        loss_fn,
        placement: Placement,
        build: Builder,
        schedule: Any = None,
        *,
        mode_specs: dict[str, str] | None = None,
        max_cached_programs: int = 8,
        observers: list[Callable[[torch.nn.Module, str], None]] | None = None,
        replicated: bool = False,
        outer_optimizer: torch.optim.Optimizer | None = None,
        replica_ranks: tuple[int, ...] = (),
    ):
        self.model = model
        self.optimizer = optimizer
        self.outer_optimizer = outer_optimizer  # DiLoCo's: steps θ_global at each sync
        self.loss_fn = loss_fn
        self.placement = placement
        self.schedule = schedule if schedule is not None else EveryStep()
        self.mode_specs = dict(mode_specs or {})
        self.max_cached_programs = max_cached_programs
        self.observers = list(observers or [])  # called after every step with (model, variant): trajectories
        self.replicated = replicated  # all ranks hold the same model and optimizer (or its slices) after updates
        self.replica_ranks = replica_ranks or (placement.rank,)  # DiLoCo: the ranks of this rank's replica
        self.extra: dict[str, torch.Tensor] = {}
        self.last_variant: str | None = None
        self.last_metrics: dict[str, float] = {}
        self.traces = 0
        self._build = build
        self._built: OrderedDict[tuple, Built] = OrderedDict()
        self._last: Built | None = None
        self._started = False
        self._batch_types: tuple | None = None
        self._agreed: bytes | None = None
        self._last_run: tuple[StepProgram, int, int | None] | None = None  # program, batch bytes, CUDA peak
        multi = placement.live and placement.world_size > 1
        self._handshake = Handshake(placement.rank, placement.world_size, placement.timeout) if multi else None
        self._guard: sharded_params.SlicedForwardGuard | None = None  # zero3: a forward on slices fails clearly
        self._gathering = False  # inside step.gathered(): the parameters are whole
        self._sliced = False  # zero3: the model's parameters are this rank's slices (cut once, again after gathered())
        self._flat = FlatStorage()  # the flat buffers the programs declare, bound to parameters and state

    # ------------------------------------------------------------ inspection
    @property
    def programs(self) -> dict[str, StepProgram]:
        """The rank's program per variant (``"step"``, or LocalSGD's ``"local"`` and ``"sync"``)."""
        if self._last is None:
            raise ConfigurationError("nothing traced yet: pass example_inputs to transpile() or run one step first.")
        return self._last.programs

    @property
    def program(self) -> StepProgram:
        """The program of the variant that runs most often (the last one listed)."""
        programs = self.programs
        return programs.get("step") or programs[next(reversed(programs))]

    @property
    def compile_seconds(self) -> dict[str, float]:
        """With ``compile=True``: per variant, how long its first call took, compiling included."""
        runners = self._last.runners if self._last is not None else {}
        return {v: r.seconds for v, r in runners.items() if getattr(r, "seconds", None) is not None}

    @property
    def captures(self) -> dict[str, int]:
        """With ``cuda_graph=True``: per variant, how many times it was captured (again after a state swap)."""
        runners = self._last.runners if self._last is not None else {}
        return {v: r.captures for v, r in runners.items() if hasattr(r, "captures")}

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten torch.fx.GraphModule this rank runs (see ``programs`` for multi-variant modes)."""
        return self.program.graph_module

    def prepare(self, batch: tuple, autocast: AutocastState | None = None) -> Built:
        """The programs for this batch, the model's current modes and structure and the autocast state (the
        caller's unless given), traced once and cached."""
        batch = tuple(batch)
        check_batch(batch, loss_fn=self.loss_fn)
        self._check_batch_types(batch)
        autocast = AutocastState.current() if autocast is None else autocast
        key = (batch_key(batch), structure_key(self.model, self.optimizer, self.outer_optimizer), autocast)
        built = self._built.get(key)
        if built is None:
            built = self._trace(key, batch, autocast)
        self._built.move_to_end(key)
        self._last = built
        return built

    def _check_batch_types(self, batch: tuple) -> None:
        types = tuple((t.dtype, t.device.type) for t in batch)
        if self._batch_types is None:
            self._batch_types = types
            return
        if types == self._batch_types:
            return
        if len(types) != len(self._batch_types):
            raise ConfigurationError(
                f"this batch has {len(types)} tensors; the step was traced for {len(self._batch_types)} "
                "(*model_inputs, target). Pass the same structure every step, or call transpile() again."
            )
        i = next(i for i, (a, b) in enumerate(zip(types, self._batch_types)) if a != b)
        (dtype, device), (was_dtype, was_device) = types[i], self._batch_types[i]
        raise ConfigurationError(
            f"batch element {i} is {dtype} on {device}; the step was traced for {was_dtype} on {was_device}. "
            "Convert it (e.g. x.to(dtype)) before the step, or call transpile() again for the new types."
        )

    def _trace(self, key: tuple, batch: tuple, autocast: AutocastState) -> Built:
        if self._built:
            last = next(reversed(self._built))
            parts = ("batch shapes", "model modes or structure", f"autocast (now {autocast})")
            changed = [what for what, was, now in zip(parts, last, key) if was != now]
            log.info("%s changed: tracing the step again", " and ".join(changed))
        start = time.perf_counter()
        built = self._build(batch, autocast)
        seconds = time.perf_counter() - start
        self.traces += 1
        if self.traces >= 4 and self.traces & (self.traces - 1) == 0:  # 4, 8, 16...: say it, without flooding
            warnings.warn(
                f"the step has been traced {self.traces} times (the last took {seconds:.1f} s): every new batch "
                "shape, set of module modes (train/eval) or set of frozen parameters costs a full trace. Keep "
                "batch shapes fixed (drop_last=True, padding) or trace them ahead with step.prepare(batch); "
                f"at most {self.max_cached_programs} programs are kept (max_cached_programs=).",
                RetraceWarning,
                stacklevel=4,
            )
        self._built[key] = built
        while len(self._built) > self.max_cached_programs:
            self._built.popitem(last=False)
        return built

    # ------------------------------------------------------------- execution
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        # grad mode as traced, no inference tensors in the state the step creates or writes back, and autocast
        # off (the graph holds the casts the caller's autocast made while tracing)
        autocast = AutocastState.current()
        with running_environment():
            return self._step(batch, autocast)

    def _step(self, batch: tuple, autocast: AutocastState) -> torch.Tensor:
        self._refuse_inside_gathered("a training step")
        built = self.prepare(batch, autocast)
        self._require_live()
        if self._handshake is not None and built.digest != self._agreed:
            self._handshake.agree(built.setup)
            self._agreed = built.digest
        if not self._started:
            self._run_startup(built)
        variant = self.schedule.variant()
        program = built.programs[variant]
        self._init_extra(built)
        self._flat.bind(program.flat_buffers, built.params, self.optimizer, self.extra)
        inputs = self._inputs(program, built, batch, variant)
        device = next(iter(built.params.values())).device if built.params else None
        on_gpu = device is not None and device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        outputs = self._run(program.graph_module, inputs, variant, built.runners[variant])
        peak = torch.cuda.max_memory_allocated(device) if on_gpu else None
        self._last_run = (program, sum(t.numel() * t.element_size() for t in batch), peak)
        metrics = self._write_back(program, built, outputs)
        self._flat.written(self.optimizer, skipped=metrics.get("overflow", 0.0) != 0.0)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.schedule.observe(variant, metrics, lr)
        self.last_variant, self.last_metrics = variant, metrics
        for observe in self.observers:
            observe(self.model, variant)
        return outputs[0]

    def _run(self, gm: torch.fx.GraphModule, inputs: list, label: str, run: Callable | None = None) -> tuple:
        """Run a graph (or ``run``, its compiled form); a failed collective becomes a CommunicationError that
        names it."""
        with failures_named(in_graph(gm, label), self.placement):
            return (run or gm)(*inputs)

    def _inputs(self, program: StepProgram, built: Built, batch: tuple, variant: str) -> list:
        if program.param_buckets:
            self._hold_slices(program, built)
        kinds = {port.kind for port in program.inputs}  # a flattened program reads no parameter or state one by one
        tensors = {
            "buffer": built.buffers,
            "batch": {f"batch{i}": t for i, t in enumerate(batch)},
            "scalar": self._scalars(program, built, variant),
            "extra": self.extra,
            "flat": self._flat.buffers,
        }
        if "param" in kinds:
            tensors["param"] = {
                port.name: built.params[port.name].detach() for port in program.inputs if port.kind == "param"
            }
        if "frozen" in kinds:
            tensors["frozen"] = {n: p.detach() for n, p in built.frozen.items()}
        if "state" in kinds:
            tensors["state"] = self._state_inputs(program, built)
        return [tensors[port.kind][port.name] for port in program.inputs]

    @staticmethod
    def _state_inputs(program: StepProgram, built: Built) -> dict[str, torch.Tensor]:
        """The optimizers' state by port name: the inner optimizer's (:meth:`_inner_state`), and the outer one's
        under ``outer/`` where the program reads it."""
        tensors = DistributedStep._inner_state(program, built)
        if built.outer is not None and any(p.kind == "state" and p.name.startswith(OUTER) for p in program.inputs):
            for i, name in enumerate(built.state.names):
                for key, t in zip(built.outer.state_keys(i), built.outer.state_tensors(i)):
                    tensors[f"{OUTER}{name}.{key}"] = t
        return tensors

    @staticmethod
    def _inner_state(program: StepProgram, built: Built) -> dict[str, torch.Tensor]:
        """The optimizer state by port name. Under a sharded mode (``program.shards``) a state tensor still
        shaped as its parameter is cut to this rank's slice, and a stored one is replaced by its slice for good
        (so the whole tensor is freed): ``optimizer.state`` then holds 1-D slices, a 0-d ``step`` whole."""
        state, plan = built.state, built.plan
        whole = built.whole
        tensors = {}
        for i, (name, param) in enumerate(zip(state.names, state.params)):
            bounds = program.shards.get(name)
            shape = torch.Size(whole.get(name, param.shape))
            for key, t in zip(plan.state_keys(i), plan.state_tensors(i)):
                sliced = bounds is not None and t.dim() > 0
                tensors[f"{name}.{key}"] = _slice_of(plan, i, key, t, bounds, shape) if sliced else t
        return tensors

    @staticmethod
    def _scalars(program: StepProgram, built: Built, variant: str) -> dict:
        """This step's scalar inputs, each from its optimizer's plan (``outer/`` ports from the outer one's):
        floats for the generic path, the twins' persistent tensors filled in place."""
        names = [port.name for port in program.inputs if port.kind == "scalar"]
        out: dict = {}
        for prefix, plan in (("", built.plan), (OUTER, built.outer)):
            mine = [n for n in names if n.startswith(OUTER) == bool(prefix)]
            if not mine:
                continue
            values = {prefix + k: v for k, v in plan.scalar_inputs([n.removeprefix(prefix) for n in mine]).items()}
            if not plan.scalars_as_tensors:
                out.update(values)
                continue
            bank = built.scalar_banks.get(prefix + variant)
            if bank is None:
                device = next(iter(built.params.values())).device if built.params else torch.device("cpu")
                bank = built.scalar_banks[prefix + variant] = ScalarBank(mine, device)
            out.update(bank.fill(values))
        return out

    def _write_back(self, program: StepProgram, built: Built, outputs: tuple) -> dict[str, float]:
        plan = built.plan
        new_states: dict[int, dict[str, torch.Tensor]] = {}
        metrics: dict[str, float] = {}
        for port, value in zip(program.outputs, outputs):
            if port.kind == "param":
                built.params[port.name].data = value
            elif port.kind == "frozen":
                built.frozen[port.name].data = value
            elif port.kind == "buffer":
                if value is not built.buffers[port.name]:
                    built.buffers[port.name].data = value
            elif port.kind == "state" and port.name.startswith(OUTER):
                name, key = port.name.removeprefix(OUTER).rsplit(".", 1)
                built.outer.write_back(built.positions[name], {key: value})
            elif port.kind == "state":
                name, key = port.name.rsplit(".", 1)
                new_states.setdefault(built.positions[name], {})[key] = value
            elif port.kind == "extra":
                self.extra[port.name] = value
            elif port.kind == "metric":
                metrics[port.name] = float(value)
        skipped = metrics.get("overflow", 0.0) != 0.0  # loss scaling skipped the update
        for position, values in new_states.items():
            if skipped:  # eager's optimizer.step() never ran, so it created no state; neither do we
                held = plan.optimizer.state.get(plan.params[position], {})
                values = {key: value for key, value in values.items() if key in held}
            plan.write_back(position, values)
        self.optimizer._opt_called = True  # what LR schedulers check to see that the optimizer stepped
        if built.outer is not None:
            self.outer_optimizer._opt_called = True
        return metrics

    def _require_live(self) -> None:
        if not self.placement.live:
            raise ConfigurationError(
                f"this step was built for world_size={self.placement.world_size} without a process group, "
                "so it can be inspected but not run. Launch with torchrun and call "
                "torch.distributed.init_process_group(...) before transpile()."
            )
        if self.placement.group_name == LOCAL_GROUP:
            ensure_local_group()

    def _run_startup(self, built: Built) -> None:
        self._started = True
        program = next((p for p in built.programs.values() if p.startup is not None), None)
        if program is None:
            return
        tensors = {"param": built.params, "frozen": built.frozen, "buffer": built.buffers}
        targets = [tensors[port.kind][port.name] for port in program.startup_ports]
        with torch.no_grad():
            results = self._run(program.startup, [t.detach() for t in targets], "startup")
            for target, value in zip(targets, results):
                target.copy_(value)

    def _init_extra(self, built: Built) -> None:
        """Create pass-added state on first use, by the rule its pass declared (after the startup broadcast)."""
        unknown = self.extra.keys() - built.extra_init.keys()
        if unknown:
            raise CheckpointError(
                f"the loaded checkpoint holds state {sorted(unknown)[:4]} that this step does not declare "
                f"(it declares {sorted(built.extra_init)[:4] or 'none'}): it comes from another mode or model."
            )
        for name, (rule, source) in built.extra_init.items():
            if name not in self.extra:
                self.extra[name] = initial_extra(rule, source, built.params)
            elif rule == "host_copy_param" and self.extra[name].device.type != "cpu":  # loaded onto the device
                self.extra[name] = self.extra[name].cpu()

    def _hold_slices(self, program: StepProgram, built: Built, keep: dict[str, torch.Tensor] | None = None) -> None:
        """ZeRO-3: the model holds this rank's slice of each sharded parameter (cut after the startup broadcast
        and after ``gathered()``, the only places they are whole, into the ``keep`` tensors where given; a
        no-op every other step), and a forward on the slices fails clearly."""
        if self._sliced:
            return
        sharded_params.hold_slices(built.params, program.param_buckets, program.shards, keep)
        self._sliced = True
        if self._guard is None:
            self._guard = sharded_params.SlicedForwardGuard(self.model, program.param_buckets, program.shards)

    @contextlib.contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[torch.nn.Module]:
        """Under ``zero3``, the model with whole parameters inside the block (each rank's slices all-gathered,
        one bucket at a time): evaluate it, save ``model.state_dict()``, or edit parameters. On leaving, every
        rank keeps its slice of what the parameters then hold (``writeback=False``: of what they held before).
        Every rank must enter it, since it all-gathers. In the other modes the parameters are whole already and
        it does nothing. Yields the model."""
        program = self.program if self._last is not None else None
        if program is None or not program.param_buckets:
            yield self.model
            return
        self._require_live()
        self._refuse_inside_gathered("step.gathered()")
        built = self._last
        self._hold_slices(program, built)
        before = {name: built.params[name].data for bucket in program.param_buckets for name in bucket.names}
        placement = self.placement
        sharded_params.gather_whole(
            built.params,
            program.param_buckets,
            program.shards,
            placement.rank,
            placement.world_size,
            program.group_name,
        )
        self._gathering, self._sliced = True, False
        try:
            yield self.model
        finally:
            self._gathering = False
            if not writeback:
                for name, data in before.items():
                    built.params[name].data = data
            self._hold_slices(program, built, keep=before)  # the same slice tensors: no new capture

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """DiLoCo's global weights θ_global by parameter name, as the last sync left them (before the first, the
        parameters themselves); the tensors the step holds, not copies. Other modes have none: an error. Under
        Streaming DiLoCo an exchange still in flight is waited for here, and applied by its ``apply`` step as
        usual: θ_global holds it only after that step."""
        if self.outer_optimizer is None:
            raise ConfigurationError(
                f"mode {self.mode_specs} keeps no global weights apart from the model's parameters; only "
                "'diloco' and 'streaming_diloco' do."
            )
        self._land_in_flight()  # the run may end with an exchange in flight: nothing is left unwaited
        names = {id(p): n for n, p in self.model.named_parameters()}
        held = {name.removeprefix(GLOBAL): t for name, t in self.extra.items() if name.startswith(GLOBAL)}
        params = self.model.named_parameters()
        return {n: held.get(n, p.detach()) for n, p in params if names[id(p)] == n and p.requires_grad}

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[torch.nn.Module]:
        """Inside the block the model holds DiLoCo's global weights θ_global (what the paper evaluates): evaluate
        it, or save ``model.state_dict()``. On leaving, each replica's own weights come back; an edit made inside
        is not kept. Yields the model. No communication: every rank holds θ_global."""
        self._refuse_inside_gathered("step.global_weights()")
        global_ = self.global_parameters()
        params = dict(self.model.named_parameters())
        before = {n: params[n].data for n in global_}
        self._gathering = True
        try:
            with torch.no_grad():
                for n, t in global_.items():
                    params[n].data = t.to(params[n].device, copy=True)  # offloaded: from host memory
            yield self.model
        finally:
            self._gathering = False
            for n, data in before.items():
                params[n].data = data

    def _refuse_inside_gathered(self, what: str) -> None:
        if self._gathering:
            raise ConfigurationError(
                f"{what} inside `with step.gathered():` or `with step.global_weights():`, where the parameters are "
                "lent to the block: leave the block first."
            )

    def memory_report(self) -> MemoryReport:
        """The bytes this rank holds between steps (parameters, gradients with the accumulators of gradient
        accumulation, optimizer state, transpiler state; each storage once, counted from the tensors held) and
        the peak during the last step (``runtime/memory_report.py``). ``print(step.memory_report())`` shows
        them in MiB."""
        if self._last_run is None or self._last is None:
            raise ConfigurationError("run a step first: the report's peak is the last step's.")
        program, batch_bytes, cuda_peak = self._last_run
        counter = StorageCounter()
        params = list(self.model.parameters())
        accumulators = [t for k, t in self.extra.items() if k.startswith(ACCUMULATOR)]
        held = {
            "parameters": counter.count(params),
            "gradients": counter.count(
                [p.grad for p in params] + bucket_buffers(self._last.programs.values()) + accumulators
            ),
            "optimizer_state": counter.count(t for s in self.optimizer.state.values() for t in s.values()),
            # where the model is: an offloaded θ_global (DiLoCo's offload_global) is host memory, not the device's
            "transpiler_state": counter.count(t for t in self.extra.values() if t.device == params[0].device),
        }
        if cuda_peak is not None:
            return MemoryReport(**held, peak=cuda_peak, peak_source="cuda allocator")
        peak = sum(held.values()) + batch_bytes + peak_transient_bytes(program.graph)
        return MemoryReport(**held, peak=peak, peak_source="program schedule")

    # ----------------------------------------------------------- checkpoints
    def checkpoint_setup(self) -> dict[str, Any]:
        """What a checkpoint must share with the step it is loaded into."""
        return {
            "mode": self.mode_specs,
            "world size": self.placement.world_size,
            "schedule": self.schedule.settings(),
            "optimizer": type(self.optimizer).__qualname__,
            **({"outer optimizer": type(self.outer_optimizer).__qualname__} if self.outer_optimizer else {}),
        }

    def state_dict(self) -> dict:
        """A snapshot (deep copy) of model, optimizer and transpiler state, for :meth:`load_state_dict`.

        A copy because ``optimizer.state_dict()`` shares its per-parameter dicts
        with the live optimizer, which every step updates. The LR scheduler is
        not included: save ``scheduler.state_dict()`` beside it. Under DiLoCo the
        outer optimizer's state is the entry ``"outer_optimizer"``, and the global
        weights are in the transpiler's ``extra`` state (``global.<param>``).
        """
        outer = {"outer_optimizer": self.outer_optimizer.state_dict()} if self.outer_optimizer is not None else {}
        self._land_in_flight()
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                **outer,
                "transpiler": {
                    "format": CHECKPOINT_FORMAT,
                    "setup": self.checkpoint_setup(),
                    "extra": self.extra,
                    "schedule": self.schedule.state_dict(),
                },
            }
        )

    def _land_in_flight(self) -> None:
        """Wait for the collectives a program left in flight for a later one (``inflight.*``, Streaming DiLoCo's
        exchange): a checkpoint then holds their results, and the later program's wait finds nothing to wait
        for."""
        for name in [k for k in self.extra if k.startswith(IN_FLIGHT)]:
            self.extra[name] = WAIT(self.extra[name])

    def save_checkpoint(self, path: str | Path) -> None:
        """Write this step's state to the folder ``path`` with ``torch.distributed.checkpoint``; every rank calls
        it. A sharded mode's ranks each write their slices of the optimizer state (and under ``zero3`` of the
        parameters); what is the same on every rank is written once. :meth:`load_checkpoint` reads it back at
        any world size, in any mode that keeps the ranks in step (``allreduce``, ``fused_allreduce``, ``zero1``,
        ``zero2``, ``zero3``), and a plain model and optimizer read it with
        ``get_state_dict``/``dcp.load``/``set_state_dict`` (``docs/checkpoints.md``)."""
        blocked = self.checkpoint_blocked()
        if blocked is not None:
            raise CheckpointError(blocked)
        if self.outer_optimizer is not None:
            return self._save_replicas(path)
        if not self.replicated:
            raise CheckpointError(
                f"mode {self.mode_specs} keeps ranks apart between updates (their parameters or state differ), so "
                "a checkpoint read at another world size has no one answer. Save step.state_dict() on every rank "
                "with torch.save, and resume at the same world size."
            )
        per_rank = sorted(k for k in self.extra if k not in REPLICATED_EXTRA and not k.startswith(ACCUMULATOR))
        if per_rank:
            raise CheckpointError(
                f"this step keeps per-rank state {per_rank[:4]} (sparsification residuals, say), which a checkpoint "
                "read at another world size cannot split. Save step.state_dict() per rank instead."
            )
        sharded_checkpoint = _checkpoint_module()
        ranks = self._checkpoint_ranks()
        with failures_named(f"saving the checkpoint {path}", self.placement):
            shards, whole = self._shards() or {}, self._held_whole()
            state = {
                "model": sharded_checkpoint.model_state(self.model, whole, shards, ranks),
                "optim": sharded_checkpoint.optimizer_state(self.optimizer, self._fqns(), shards, ranks, whole),
                "transpiler": {
                    "extra": {k: v for k, v in self.extra.items() if k.startswith(REPLICATED_EXTRA)},
                    "schedule": self.schedule.state_dict(),
                    "setup": self._checkpoint_kind(),
                },
            }
            sharded_checkpoint.save(state, path, ranks)

    def checkpoint_blocked(self) -> str | None:
        """Why :meth:`save_checkpoint` cannot run now (None: it can): in the middle of an accumulation cycle, or
        with a Streaming DiLoCo exchange in flight. A ``Checkpointer`` saves at the first call that leaves
        neither."""
        if self.schedule.state_dict().get("micro_step", 0):
            return (
                "save_checkpoint() in the middle of an accumulation cycle would drop the gradients accumulated so "
                "far; call it after the cycle's last micro-step (when step.last_variant is not 'accumulate')."
            )
        if exchange_in_flight(self.schedule):
            return (
                "save_checkpoint() with a Streaming DiLoCo exchange in flight: its sum belongs to this world (and "
                "under a quantised exchange each rank holds its own part), so no other world could resume it. Call "
                "it after the step that applies it (when step.checkpoint_blocked() is None), as a Checkpointer does."
            )
        return None

    def _save_replicas(self, path: str | Path) -> None:
        """DiLoCo's checkpoint: θ_global, the outer state and the schedule once, each replica's weights and inner
        state as its row (``runtime/replica_checkpoint.py``)."""
        replica_checkpoint = _replica_checkpoint_module()
        own = {k: v for k, v in self.extra.items() if not k.startswith((GLOBAL, IN_FLIGHT, ACCUMULATOR))}
        ranks = self._checkpoint_ranks()
        with failures_named(f"saving the checkpoint {path}", self.placement):
            replica_checkpoint.save(
                path,
                model=self.model,
                optimizer=self.optimizer,
                outer=self.outer_optimizer,
                global_params=self.global_parameters(),
                extra=own,
                transpiler={"schedule": self.schedule.state_dict(), "setup": self._checkpoint_kind()},
                shards=self._shards() or {},
                replica=self._replica(),
                ranks=ranks,
            )

    def _checkpoint_kind(self) -> dict[str, Any]:
        """What a DCP checkpoint's reader must match: the format, the optimizers, and whether rows per replica."""
        kind = {"format": CHECKPOINT_FORMAT, "optimizer": type(self.optimizer).__qualname__}
        if self.outer_optimizer is not None:
            kind |= {"outer optimizer": type(self.outer_optimizer).__qualname__, "layout": "replicas"}
        return kind

    def _replica(self) -> Any:  # replica_checkpoint.Replica (imported with the checkpoint modules)
        placement = self.placement
        return _replica_checkpoint_module().Replica.of(placement.rank, placement.world_size, self.replica_ranks)

    def _load_replicas(self, path: str | Path) -> None:
        replica_checkpoint = _replica_checkpoint_module()
        ranks = self._checkpoint_ranks()
        loaded = replica_checkpoint.load(
            path,
            model=self.model,
            optimizer=self.optimizer,
            outer=self.outer_optimizer,
            shards=self._shards(),
            replica=self._replica(),
            ranks=ranks,
        )
        self.schedule.load_state_dict(loaded.schedule)
        self.extra = {f"{GLOBAL}{name}": t for name, t in loaded.global_params.items()} | loaded.extra

    def load_checkpoint(self, path: str | Path) -> None:
        """Read a :meth:`save_checkpoint` folder, written at any world size and mode that keeps ranks in step,
        into this step; every rank calls it. Once the step is built (``example_inputs`` or a first step), each
        rank reads only its own slices of a sharded optimizer state; before, it reads whole tensors and cuts
        them at the first step."""
        sharded_checkpoint = _checkpoint_module()
        with failures_named(f"loading the checkpoint {path}", self.placement):
            self._check_kind(path, sharded_checkpoint.read_setup(path, self._checkpoint_ranks()))
            if self.outer_optimizer is not None:
                self._load_replicas(path)
            else:
                self._load_in_step(path)
        if self._last is not None:
            self._init_extra(self._last)
        self._started = True

    def _check_kind(self, path: str | Path, saved: dict[str, Any]) -> None:
        mine = self._checkpoint_kind()
        if saved.get("format") != CHECKPOINT_FORMAT or saved.get("optimizer") != mine["optimizer"]:
            raise CheckpointError(
                f"the checkpoint holds {saved.get('optimizer')} state in format {saved.get('format')}; this "
                f"step's optimizer is {mine['optimizer']} and it reads format {CHECKPOINT_FORMAT}."
            )
        if saved.get("layout") == mine.get("layout") == "replicas":
            if saved.get("outer optimizer") != mine["outer optimizer"]:
                raise CheckpointError(
                    f"the checkpoint holds {saved.get('outer optimizer')} outer state; this step's outer optimizer "
                    f"is {mine['outer optimizer']}."
                )
        elif saved.get("layout") == "replicas":
            raise CheckpointError(
                f"{path} was written by a DiLoCo step (a row of weights and inner state per replica), and this "
                "step's mode keeps every rank in step. To start from its global weights, read its 'model' entry "
                "into the model with torch.distributed.checkpoint.load before transpile() (docs/checkpoints.md)."
            )
        elif mine.get("layout") == "replicas":
            raise CheckpointError(
                f"{path} was written in a mode that keeps every rank in step, and a DiLoCo step reads only DiLoCo "
                "checkpoints. To start DiLoCo from it (the paper's warm start), read it into the model and the "
                "inner optimizer with torch.distributed.checkpoint before transpile() (docs/checkpoints.md)."
            )

    def _load_in_step(self, path: str | Path) -> None:
        """The checkpoint of a mode that keeps ranks in step: this rank's slices of what is sharded."""
        sharded_checkpoint = _checkpoint_module()
        ranks = self._checkpoint_ranks()
        names = self._fqns()
        shards, whole = self._shards(), self._held_whole()
        model = sharded_checkpoint.model_state(self.model, whole, shards or {}, ranks)
        template, slices = sharded_checkpoint.load_template(
            path, model, self.model, self.optimizer, names, shards, ranks, whole
        )
        sharded_checkpoint.load(template, path, ranks)
        optim = template["optim"]
        state = {
            name: {key: slices.get((name, key), value) for key, value in entries.items()}
            for name, entries in optim["state"].items()
        }
        sharded_checkpoint.load_optimizer(self.optimizer, names, state, optim["param_groups"])
        self.schedule.load_state_dict(template.get("transpiler", {}).get("schedule", {}))
        self.extra = dict(template.get("transpiler", {}).get("extra", {}))

    def _checkpoint_ranks(self) -> Ranks:
        """Where DCP's collectives run: on the step's group, so the step's timeout bounds a checkpoint too."""
        return _checkpoint_module().Ranks(self.placement.rank, self.placement.world_size, live_group(self.placement))

    def _shards(self) -> dict[str, tuple[int, int]] | None:
        """This rank's ``[lo, hi)`` of each sharded parameter, once the step is built (the same in every
        variant); None before."""
        return self._last.programs[next(iter(self._last.programs))].shards if self._last is not None else None

    def _held_whole(self) -> dict[str, tuple[int, ...]]:
        """ZeRO-3, once the step is built: the whole shape of each parameter, and the model now holds this rank's
        slices of them (cut here if no step has yet). Empty in other modes."""
        if self._last is None or not self.program.param_buckets:
            return {}
        self._refuse_inside_gathered("a checkpoint")
        self._hold_slices(self.program, self._last)
        return {name: tuple(shape) for name, shape in self._last.whole.items()}

    def _fqns(self) -> dict[int, str]:
        """Each parameter's name in the model (a tied one under its first name), by ``id``."""
        return {id(p): name for name, p in self.model.named_parameters()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` exactly, on this rank, after checking it fits this step.

        Every rank keeps what it loads (no broadcast from rank 0 afterwards), so
        per-rank state such as BatchNorm statistics and LocalSGD's drift
        between syncs comes back as saved.
        """
        if not isinstance(state_dict, dict) or not {"model", "optimizer", "transpiler"} <= set(state_dict):
            raise CheckpointError(
                "a checkpoint for step.load_state_dict() has 'model', 'optimizer' and 'transpiler' entries, as "
                "step.state_dict() returns it. For a plain model checkpoint use model.load_state_dict()."
            )
        saved = state_dict["transpiler"]
        if self._last is None and any(ShardParams.name in spec for spec in self.mode_specs.values()):
            raise CheckpointError(
                "under zero3 a step.state_dict() holds this rank's slices of the parameters, and the step learns "
                "which slices are its own when it is built: pass example_inputs= to transpile() (or call "
                "step.prepare(batch)) before step.load_state_dict(). step.load_checkpoint() needs neither."
            )
        self._held_whole()  # zero3: the model holds its slices, as the checkpoint does
        self._check_checkpoint(saved, state_dict["model"], state_dict["optimizer"], state_dict)
        self.model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.outer_optimizer is not None:
            self.outer_optimizer.load_state_dict(state_dict["outer_optimizer"])
        self.schedule.load_state_dict(saved.get("schedule", {}))
        self.extra = {k: v.clone() for k, v in saved.get("extra", {}).items()}
        if self._last is not None:
            self._init_extra(self._last)  # an unknown entry fails now, not at the next step
        self._started = True

    def _check_checkpoint(self, saved: dict, model_state: dict, optimizer_state: dict, whole_state: dict) -> None:
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"checkpoint format {saved.get('format')!r}, this version reads {CHECKPOINT_FORMAT}; load its "
                "'model' and 'optimizer' entries with model.load_state_dict() and optimizer.load_state_dict()."
            )
        mine = self.checkpoint_setup()
        problems = [
            f"{key}: checkpoint {value!r}, this step {mine.get(key)!r}"
            for key, value in saved.get("setup", {}).items()
            if mine.get(key) != value
        ]
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(model_state)), sorted(set(model_state) - set(own))
        if missing or unexpected:
            problems.append(f"model entries missing {missing[:4]}, unexpected {unexpected[:4]}")
        shapes = [
            f"{n} {list(model_state[n].shape)} vs {list(t.shape)}"
            for n, t in own.items()
            if n in model_state and torch.is_tensor(t) and tuple(model_state[n].shape) != tuple(t.shape)
        ]
        if shapes:
            problems.append("model shapes differ (checkpoint vs this model): " + ", ".join(shapes[:4]))
        if self.outer_optimizer is not None and "outer_optimizer" not in whole_state:
            problems.append("it holds no outer optimizer state ('outer_optimizer'), which this DiLoCo step keeps")
        groups = optimizer_state.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optimizer.param_groups]:
            problems.append("the optimizer's param groups hold other numbers of parameters")
        if problems:
            hint = (
                " To resume at another world size or in another mode on purpose, load the 'model' and 'optimizer' "
                "entries directly (model.load_state_dict, optimizer.load_state_dict)."
            )
            raise CheckpointError("the checkpoint does not fit this step:\n  - " + "\n  - ".join(problems) + hint)
