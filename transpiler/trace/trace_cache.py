"""Traces kept by signature, for a process that builds many steps of the same model and optimizer: several modes,
fresh instances (a benchmark's sweep, a test's references), retraces for a batch shape or eval mode seen before."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from transpiler.errors import ConfigurationError

from .environment import AutocastState
from .optimizers import OptimizerPlan, as_optimizer
from .signature import StepSignature, StepTrace
from .step_inputs import LossFn, ModelState
from .tracer import trace_step


class TraceCache:
    """``transpile(..., trace=cache)`` builds every program of the step from the trace this cache holds for its
    signature (``signature.py``: the model's structure, classes and attributes, the tensors' shapes, the
    optimizer and its fixed hyper-parameters, the loss, the batch, autocast), tracing and keeping one it has not
    seen. ``cache.trace(model, optimizer, loss_fn, batch)`` gives one ahead. Equal signatures must mean the
    same code: a class redefined under the same name, or a forward that reads a global, is not seen. It keeps the
    ``max_traces`` used most recently (a run whose batch shapes keep changing would otherwise keep a trace per
    shape for ever)."""

    def __init__(self, max_traces: int = 32) -> None:
        if isinstance(max_traces, bool) or not isinstance(max_traces, int) or max_traces < 1:
            raise ConfigurationError(f"max_traces must be an int >= 1, got {max_traces!r}.")
        self.max_traces = max_traces
        self._traces: OrderedDict[StepSignature, StepTrace] = OrderedDict()
        self.hits = 0  # builds that reused a trace
        self.misses = 0  # traces made

    def __len__(self) -> int:
        return len(self._traces)

    def trace(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_fn: LossFn = None,
        batch: tuple = (),
    ) -> StepTrace:
        """The trace of this step under the caller's autocast state, made on its first request."""
        return self.signed(model, as_optimizer(optimizer), loss_fn, tuple(batch), AutocastState.current())[0]

    def signed(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        batch: tuple,
        autocast: AutocastState,
        shards: Mapping[str, tuple[int, int]] | None = None,
        whole_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> tuple[StepTrace, ModelState, OptimizerPlan]:
        """:func:`~transpiler.trace.tracer.trace_step` through the cache."""
        args = (model, optimizer, loss_fn, batch, autocast, shards, whole_shapes)
        trace, state, plan = trace_step(*args, reuse=self._traces)
        if trace.signature in self._traces:  # a copy of the one kept
            self._traces.move_to_end(trace.signature)
            self.hits += 1
            return trace, state, plan
        self._traces[trace.signature] = trace  # kept as traced; the caller's copy shares its graphs, never rewritten
        while len(self._traces) > self.max_traces:
            self._traces.popitem(last=False)
        self.misses += 1
        return dataclasses.replace(trace, program=trace.program.sharing_graphs()), state, plan
