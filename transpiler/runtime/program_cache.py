"""The programs a step has built, one entry per cache key, and when to trace again.

What a program depends on is its cache key: the batch's shapes, which modules are in training mode, which
parameters require grad, the model's parameter and buffer objects, the optimizer's param groups and the caller's
autocast state. A call whose key is new traces again (an LRU of ``max_cached_programs`` entries, and a warning
when it keeps happening); a batch whose number of tensors, dtypes or devices changed is refused instead, since a
silent retrace would hide a data-pipeline bug.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from transpiler.errors import ConfigurationError, RetraceWarning
from transpiler.graph.ports import ExtraInit
from transpiler.graph.program import StepProgram
from transpiler.trace.environment import AutocastState
from transpiler.trace.optimizers import TWINS, OptimizerPlan
from transpiler.trace.step_inputs import ModelState, check_batch

from .handshake import Setup
from .program_ports import ProgramPorts
from .scalar_bank import ScalarBank

log = logging.getLogger("transpiler")


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
    extra_init: dict[str, ExtraInit] = field(init=False)  # pass-added state of every variant -> its rule
    whole: dict[str, torch.Size] = field(init=False)  # ZeRO-3: each parameter held as a slice -> its whole shape
    # a sharded mode: each parameter -> this rank's [lo, hi) of it, from every variant (under zero1 an accumulation
    # micro-step's program holds none: the variant that updates says)
    shards: dict[str, tuple[int, int]] = field(init=False)
    digest: bytes = field(init=False)  # of the setup: equal digests need no new handshake
    ports: dict[str, ProgramPorts] = field(init=False)  # variant -> what its feed and write-back read per step

    def __post_init__(self) -> None:
        self.params = dict(zip(self.state.names, self.state.params))
        self.frozen = dict(zip(self.state.frozen_names, self.state.frozen))
        self.buffers = dict(zip(self.state.buffer_names, self.state.buffers))
        self.positions = {n: i for i, n in enumerate(self.state.names)}
        self.extra_init = {name: rule for p in self.programs.values() for name, rule in p.extra_init.items()}
        self.whole = {
            n: torch.Size(s) for p in self.programs.values() for b in p.param_buckets for n, s in zip(b.names, b.shapes)
        }
        self.shards = {n: bounds for p in self.programs.values() for n, bounds in p.shards.items()}
        self.runners = {v: self.runners.get(v, p.graph_module) for v, p in self.programs.items()}
        self.digest = hashlib.sha256(pickle.dumps(self.setup)).digest()
        self.ports = {v: ProgramPorts.of(p, self.params) for v, p in self.programs.items()}

    @property
    def main(self) -> StepProgram:
        """The program of the variant that runs most often: ``step``, else the last variant listed."""
        return self.programs.get("step") or self.programs[next(reversed(self.programs))]

    @property
    def device(self) -> torch.device:
        """Where the parameters are (the CPU for a model without any)."""
        return next(iter(self.params.values())).device if self.params else torch.device("cpu")


Builder = Callable[[tuple, AutocastState], Built]


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
    for m in _modules(model):
        parts.append(m.training)
        parts.extend((id(p), p is not None and p.requires_grad) for p in m._parameters.values())
        parts.extend(id(b) for b in m._buffers.values())
    parts.extend(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)
    for opt in (optimizer, outer) if outer is not None else (optimizer,):
        if type(opt) not in TWINS:  # the generic path's first step creates the state, the second reads it
            parts.append(tuple(bool(opt.state.get(p)) for g in opt.param_groups for p in g["params"]))
    return tuple(parts)


def _modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.modules()``, each once, in a plain walk: a third of what ``named_modules``' recursive generators
    cost, and this runs before every step."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
            stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return out


class ProgramCache:
    """The built programs by cache key, least recently used first; ``build`` traces and rewrites a new key."""

    def __init__(self, build: Builder, loss_fn: object, max_cached_programs: int) -> None:
        self.build = build
        self.loss_fn = loss_fn
        self.max_cached_programs = max_cached_programs
        self.entries: OrderedDict[tuple, Built] = OrderedDict()
        self.traces = 0
        self._batch_types: tuple | None = None

    def prepare(
        self,
        batch: tuple,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        outer: torch.optim.Optimizer | None,
        autocast: AutocastState | None,
    ) -> Built:
        """The programs for this batch, the model's modes and structure and ``autocast`` (the caller's state when
        None), traced on a new key."""
        batch = tuple(batch)
        check_batch(batch, loss_fn=self.loss_fn)
        self._check_batch_types(batch)
        autocast = AutocastState.current() if autocast is None else autocast
        key = (batch_key(batch), structure_key(model, optimizer, outer), autocast)
        built = self.entries.get(key)
        if built is None:
            built = self._trace(key, batch, autocast)
        self.entries.move_to_end(key)
        if self._batch_types is None:  # the types of the first batch that traced: a refused one sets nothing
            self._batch_types = tuple((t.dtype, t.device.type) for t in batch)
        return built

    def _check_batch_types(self, batch: tuple) -> None:
        types = tuple((t.dtype, t.device.type) for t in batch)
        if self._batch_types is None or types == self._batch_types:
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
        if self.entries:
            last = next(reversed(self.entries))
            parts = ("batch shapes", "model modes or structure", f"autocast (now {autocast})")
            changed = [what for what, was, now in zip(parts, last, key) if was != now]
            log.info("%s changed: tracing the step again", " and ".join(changed))
        start = time.perf_counter()
        built = self.build(batch, autocast)
        seconds = time.perf_counter() - start
        self.traces += 1
        if self.traces >= 4 and self.traces & (self.traces - 1) == 0:  # 4, 8, 16...: say it, without flooding
            warnings.warn(
                f"the step has been traced {self.traces} times (the last took {seconds:.1f} s): every new batch "
                "shape, set of module modes (train/eval) or set of frozen parameters costs a full trace. Keep "
                "batch shapes fixed (drop_last=True, padding) or trace them ahead with step.prepare(batch); "
                f"at most {self.max_cached_programs} programs are kept (max_cached_programs=).",
                RetraceWarning,
                stacklevel=5,
            )
        self.entries[key] = built
        while len(self.entries) > self.max_cached_programs:
            self.entries.popitem(last=False)
        return built
