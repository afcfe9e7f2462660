"""Runs a rank's step programs and keeps the model and optimizer up to date.

The runtime owns no training state of the model's: parameters and buffers live
in the user's model, optimizer state in ``optimizer.state``. Each call feeds
them to the graph and writes the graph's results back (re-binding ``.data``;
after ``reinplace-optimizer`` the results are the same storage, updated in
place). State that passes add (LocalSGD snapshots, say) lives here, in
``extra``, and travels in :meth:`state_dict`. Inputs and outputs are matched
by their ports, so a pass can add either.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigurationError
from .optimizers import OptimizerPlan
from .process_group import LOCAL_GROUP, Placement, ensure_local_group
from .program import StepProgram
from .schedules import EveryStep
from .tracing import ModelState, check_batch

log = logging.getLogger("transpiler")


@dataclass
class Built:
    """Everything traced for one batch shape: a program per variant, and the model/optimizer layout."""

    programs: dict[str, StepProgram]
    state: ModelState
    plan: OptimizerPlan
    params: dict[str, torch.nn.Parameter] = field(init=False)  # name maps, made once, read every step
    frozen: dict[str, torch.nn.Parameter] = field(init=False)
    buffers: dict[str, torch.Tensor] = field(init=False)
    positions: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.params = dict(zip(self.state.names, self.state.params))
        self.frozen = dict(zip(self.state.frozen_names, self.state.frozen))
        self.buffers = dict(zip(self.state.buffer_names, self.state.buffers))
        self.positions = {n: i for i, n in enumerate(self.state.names)}


Builder = Callable[[tuple], Built]


def batch_key(batch: tuple) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in batch)


class DistributedStep:
    """One training step per call on this rank's batch shard; returns this rank's loss."""

    def __init__(self, model, optimizer, loss_fn, placement: Placement, build: Builder, schedule: Any = None):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.placement = placement
        self.schedule = schedule if schedule is not None else EveryStep()
        self.extra: dict[str, torch.Tensor] = {}
        self.last_variant: str | None = None
        self.last_metrics: dict[str, float] = {}
        self._build = build
        self._built: dict[tuple, Built] = {}
        self._last: Built | None = None
        self._started = False

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
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten torch.fx.GraphModule this rank runs (see ``programs`` for multi-variant modes)."""
        return self.program.graph_module

    def prepare(self, batch: tuple) -> Built:
        """Trace and rewrite the step for this batch's shapes (cached)."""
        check_batch(tuple(batch), loss_fn=self.loss_fn)
        key = batch_key(batch)
        if key not in self._built:
            if self._built:
                log.info("batch shapes %s are new: tracing the step again", [k[0] for k in key])
            self._built[key] = self._build(tuple(batch))
        self._last = self._built[key]
        return self._last

    # ------------------------------------------------------------- execution
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        built = self.prepare(batch)
        self._require_live()
        if not self._started:
            self._run_startup(built)
        variant = self.schedule.variant()
        program = built.programs[variant]
        self._init_extra(program, built)
        with torch.no_grad():
            outputs = program.graph_module(*self._inputs(program, built, batch))
        metrics = self._write_back(program, built, outputs)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.schedule.observe(variant, metrics, lr)
        self.last_variant, self.last_metrics = variant, metrics
        return outputs[0]

    def _inputs(self, program: StepProgram, built: Built, batch: tuple) -> list:
        state, plan = built.state, built.plan
        tensors = {
            "param": {n: p.detach() for n, p in built.params.items()},
            "frozen": {n: p.detach() for n, p in built.frozen.items()},
            "buffer": built.buffers,
            "state": {
                f"{state.names[i]}.{k}": t
                for i in range(len(state.params))
                for k, t in zip(plan.state_keys(i), plan.state_tensors(i))
            },
            "batch": {f"batch{i}": t for i, t in enumerate(batch)},
            "scalar": {s.name: v for s, v in zip(plan.scalar_slots(), plan.scalar_values())},
            "extra": self.extra,
        }
        return [tensors[port.kind][port.name] for port in program.inputs]

    def _write_back(self, program: StepProgram, built: Built, outputs: tuple) -> dict[str, float]:
        plan = built.plan
        new_states: dict[int, dict[str, torch.Tensor]] = {}
        metrics: dict[str, float] = {}
        for port, value in zip(program.outputs, outputs):
            if port.kind == "param":
                built.params[port.name].data = value
            elif port.kind == "buffer":
                if value is not built.buffers[port.name]:
                    built.buffers[port.name].data = value
            elif port.kind == "state":
                name, key = port.name.rsplit(".", 1)
                new_states.setdefault(built.positions[name], {})[key] = value
            elif port.kind == "extra":
                self.extra[port.name] = value
            elif port.kind == "metric":
                metrics[port.name] = float(value)
        for position, values in new_states.items():
            plan.write_back(position, [values[k] for k in plan.state_keys(position)])
        self.optimizer._opt_called = True  # what LR schedulers check to see that the optimizer stepped
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
            results = program.startup(*(t.detach() for t in targets))
            for target, value in zip(targets, results):
                target.copy_(value)

    def _init_extra(self, program: StepProgram, built: Built) -> None:
        """Create pass-added state on first use, by the rule its pass declared (after the startup broadcast)."""
        for name, (rule, source) in program.extra_init.items():
            if name in self.extra:
                continue
            if rule != "copy_param":
                raise ConfigurationError(f"unknown initialisation rule '{rule}' for extra state '{name}'.")
            self.extra[name] = built.params[source].detach().clone()

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """A snapshot (deep copy) of model, optimizer and transpiler state, for :meth:`load_state_dict`.

        A copy because ``optimizer.state_dict()`` shares its per-parameter dicts
        with the live optimizer, which every step updates.
        """
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "transpiler": {
                    "world_size": self.placement.world_size,
                    "extra": self.extra,
                    "schedule": self.schedule.state_dict(),
                },
            }
        )

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"model", "optimizer"} - set(state_dict)
        if missing:
            raise ConfigurationError(f"state_dict lacks {sorted(missing)}; pass what step.state_dict() returned.")
        self.model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        saved = state_dict.get("transpiler", {})
        self.extra = {k: v.clone() for k, v in saved.get("extra", {}).items()}
        self.schedule.load_state_dict(saved.get("schedule", {}))
        self._started = self._started or bool(self.extra)
