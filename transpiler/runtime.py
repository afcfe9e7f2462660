"""Runs a rank's step program and keeps the model and optimizer up to date.

The runtime owns no training state of its own: parameters and buffers live in
the user's model, optimizer state in ``optimizer.state``. Each call feeds them
to the graph and writes the graph's results back (re-binding ``.data``, so no
copy), which keeps checkpoints and evaluation code working unchanged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch

from .errors import ConfigurationError
from .optimizers import OptimizerPlan
from .process_group import LOCAL_GROUP, Placement, ensure_local_group
from .program import StepProgram
from .tracing import ModelState, check_batch

log = logging.getLogger("transpiler")
Builder = Callable[[tuple], tuple[StepProgram, ModelState, OptimizerPlan]]


def batch_key(batch: tuple) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in batch)


class DistributedStep:
    """One training step per call on this rank's batch shard; returns this rank's loss."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn, placement: Placement, build: Builder
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.placement = placement
        self._build = build
        self._programs: dict[tuple, tuple[StepProgram, ModelState, OptimizerPlan]] = {}
        self._last: StepProgram | None = None
        self._started = False

    # ------------------------------------------------------------ inspection
    @property
    def program(self) -> StepProgram:
        if self._last is None:
            raise ConfigurationError("nothing traced yet: pass example_inputs to transpile() or run one step first.")
        return self._last

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten torch.fx.GraphModule this rank runs."""
        return self.program.graph_module

    def prepare(self, batch: tuple) -> StepProgram:
        """Trace and rewrite the step for this batch's shapes (cached)."""
        check_batch(tuple(batch), loss_fn=self.loss_fn)
        key = batch_key(batch)
        if key not in self._programs:
            if self._programs:
                log.info("batch shapes %s are new: tracing the step again", [k[0] for k in key])
            self._programs[key] = self._build(tuple(batch))
        self._last = self._programs[key][0]
        return self._last

    # ------------------------------------------------------------- execution
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        program = self.prepare(batch)
        _, state, plan = self._programs[batch_key(batch)]
        self._require_live()
        if not self._started:
            self._run_startup(program, state)
        inputs = [
            *(p.detach() for p in state.params),
            *(p.detach() for p in state.frozen),
            *state.buffers,
            *(t for i in range(len(state.params)) for t in plan.state_tensors(i)),
            *batch,
            *plan.scalar_values(),
        ]
        with torch.no_grad():
            outputs = program.graph_module(*inputs)
        self._write_back(outputs, state, plan)
        return outputs[0]

    def _require_live(self) -> None:
        if not self.placement.live:
            raise ConfigurationError(
                f"this step was built for world_size={self.placement.world_size} without a process group, "
                "so it can be inspected but not run. Launch with torchrun and call "
                "torch.distributed.init_process_group(...) before transpile()."
            )
        if self.placement.group_name == LOCAL_GROUP:
            ensure_local_group()

    def _run_startup(self, program: StepProgram, state: ModelState) -> None:
        self._started = True
        if program.startup is None:
            return
        tensors = {("param", n): p for n, p in zip(state.names, state.params)}
        tensors.update({("frozen", n): p for n, p in zip(state.frozen_names, state.frozen)})
        tensors.update({("buffer", n): b for n, b in zip(state.buffer_names, state.buffers)})
        targets = [tensors[(port.kind, port.name)] for port in program.startup_ports]
        with torch.no_grad():
            results = program.startup(*(t.detach() for t in targets))
            for target, value in zip(targets, results):
                target.copy_(value)

    def _write_back(self, outputs: tuple, state: ModelState, plan: OptimizerPlan) -> None:
        n_p = len(state.params)
        new_params = outputs[1 : 1 + n_p]
        pos = 1 + n_p
        for p, new in zip(state.params, new_params):
            p.data = new
        for i in range(n_p):
            count = len(plan.state_keys(i))
            plan.write_back(i, list(outputs[pos : pos + count]))
            pos += count
        for b, new in zip(state.buffers, outputs[pos:]):
            if new is not b:
                b.data = new
        self.optimizer._opt_called = True  # what LR schedulers check to see that the optimizer stepped

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
                "transpiler": {"world_size": self.placement.world_size},
            }
        )

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"model", "optimizer"} - set(state_dict)
        if missing:
            raise ConfigurationError(f"state_dict lacks {sorted(missing)}; pass what step.state_dict() returned.")
        self.model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
