"""What the planner knows of a step, taken once from the model: its bytes, its schedule's peak, its compute.

- **Bytes** from the traced step (one trace, fake tensors): the trainable parameters one by one, the rest of the
  parameters and buffers, the optimizer's state, the batch, and the step's own tensors at their peak by its
  schedule (``graph/memory.py``'s estimate, the one a ``memory_budget`` bounds).
- **Recompute**: the ``recompute`` pass run on a copy of the traced step at each budget the planner may choose
  (``passes/recompute.py``): the peak it reaches, and the work it adds as a share of the forward's, both priced on
  the pass's own roofline (``passes/recompute_cost.py``) so only their ratio counts.
- **Compute**: forward with the loss, backward and the update, timed eagerly on a copy of the model and optimizer
  (a warm-up, then the median of seven runs' totals, split as the phases' medians split), unless the cluster carries
  times a calibration measured.
- **Tensor parallelism**, where the user gives a plan: what it splits, read against the model
  (``planner/tensor_parallel.py``).
- **Pipeline cuts**: the blocks a pipeline may cut at (the longest ``ModuleList`` or ``Sequential``, as
  ``PipelineParallel`` takes them) and the bytes of the largest tensor entering one, what a stage sends a
  microbatch's share of.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.fx as fx

from passes.recompute_cost import recompute_seconds
from transpiler.api import trace_training_step
from transpiler.build import fit_budget
from transpiler.graph.memory import memory_estimate, peak_transient_bytes, tensors_of
from transpiler.runtime.execution import Execution
from transpiler.strategies.pipeline_parallel import longest_block_list
from transpiler.trace.optimizers import as_optimizer

from .cluster import ComputeTimes
from .tensor_parallel import TensorParallelShape, tensor_parallel_shape

TIMED_RUNS = 7  # a calibration under load varied by up to 1.8× over three runs (bench/planner.py's MLP update)


@dataclass(frozen=True)
class RecomputeLevel:
    """The step at one ``memory_budget``: the peak of its own tensors, and the forward work it adds (a share)."""

    budget: float
    transient: int
    extra_forward: float


@dataclass(frozen=True)
class StepProfile:
    """One rank's step at the example batch, as every candidate's estimate starts from it (module docstring)."""

    parameters: tuple[tuple[str, int], ...]  # trainable parameters in order: (name, bytes)
    other_bytes: int  # parameters that do not train, and buffers
    state_bytes: int  # the optimizer's state
    batch_bytes: int
    batch_size: int
    transient: int  # the step's own tensors at their peak, without recompute, the update's left out
    recompute: tuple[RecomputeLevel, ...]
    largest_module_bytes: int  # the parameters of the largest module without children: zero3's gathered unit
    blocks: int  # the blocks a pipeline may cut at
    boundary_bytes: int  # the largest tensor entering a block, for the whole batch
    compute: ComputeTimes
    segment_seconds: tuple[float, ...] = ()  # the forward before the first block, each block (the last with the rest)
    segment_bytes: tuple[int, ...] = ()  # the trainable parameters first used in each of those segments
    tensor_parallel: TensorParallelShape | None = None  # what the user's tensor-parallel plan splits, where given

    @property
    def parameter_bytes(self) -> int:
        return sum(size for _, size in self.parameters)


def profile_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    batch: tuple,
    compute: ComputeTimes | None = None,
    budgets: tuple[float, ...] = (0.0,),
    tp_plan: dict | None = None,
) -> StepProfile:
    """Trace the step once and take what the planner prices (module docstring); ``compute`` given (a
    calibration's) is kept, else measured here. ``tp_plan``: the user's tensor-parallel plan, read against the
    model (planner/tensor_parallel.py)."""
    trace = trace_training_step(model, optimizer, loss_fn, batch)
    estimate = memory_estimate(trace.program)
    trainable = tuple((n, p.numel() * p.element_size()) for n, p in model.named_parameters() if p.requires_grad)
    blocks, boundary, segments, segment_bytes = _blocks(model, loss_fn, batch)
    return StepProfile(
        parameters=trainable,
        other_bytes=estimate.parameters - sum(size for _, size in trainable),
        state_bytes=estimate.optimizer_state,
        batch_bytes=estimate.batch,
        batch_size=int(batch[0].shape[0]) if isinstance(batch[0], torch.Tensor) and batch[0].dim() else 1,
        transient=_own_peak(trace.program.graph),
        recompute=tuple(_recompute_level(trace.program, b) for b in budgets),
        largest_module_bytes=max(
            (sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()),
            default=0,
        ),
        blocks=blocks,
        boundary_bytes=boundary,
        segment_seconds=segments,
        segment_bytes=segment_bytes,
        compute=compute or measure_compute(model, optimizer, loss_fn, batch),
        tensor_parallel=tensor_parallel_shape(model, tp_plan, loss_fn, batch) if tp_plan is not None else None,
    )


def _recompute_level(traced, budget: float) -> RecomputeLevel:
    """The traced step after the ``recompute`` pass at ``budget`` (a copy; the trace stays as it was)."""
    program = copy.deepcopy(traced)
    fit_budget(program, {}, Execution(memory_budget=budget, verify=False))
    forward = sum(recompute_seconds(n) for n in traced.graph.nodes if n.meta.get("role") == "forward")
    added = sum(recompute_seconds(n) for n in program.graph.nodes if "recomputed_from" in n.meta)
    return RecomputeLevel(budget, _own_peak(program.graph), added / forward if forward else 0.0)


def _own_peak(graph: fx.Graph) -> int:
    """The step's own tensors at their peak, the optimizer's left out: the traced update is functional (new
    parameters and state), and every distributed program updates in place (``reinplace-optimizer``, the flat and
    foreach updates), so those tensors are not made there; an MLP's traced peak is its update's (three times
    its parameters), its programs' the end of the backward."""
    return peak_transient_bytes(graph, lambda node: node.meta.get("role") != "optimizer")


def _blocks(model: torch.nn.Module, loss_fn, batch: tuple) -> tuple[int, int, tuple[float, ...], tuple[int, ...]]:
    """How many blocks a pipeline may cut at, the bytes of the largest tensor entering one, and by the segments a
    pipeline's balanced cut weighs (``passes/stage_balance.py``: before the first block, then each block, the last
    with what follows it) the forward's time and the bytes of the trainable parameters first used there. An eager
    forward on no gradient, a warm-up then one timed."""
    name, children = longest_block_list(model)
    if not children:
        return 0, 0, (), ()
    container = model.get_submodule(name) if name else model
    sizes: list[int] = []
    stamps: list[float] = []
    first_used: dict[str, int] = {}  # a module owning trainable parameters -> the segment it first runs in

    def enter(_module: torch.nn.Module, args: tuple) -> None:
        stamps.append(time.perf_counter())
        sizes.append(sum(t.numel() * t.element_size() for t in tensors_of(list(args))))

    def owner(module_name: str):
        def first(_module: torch.nn.Module, _args: tuple) -> None:
            first_used.setdefault(module_name, len(stamps))

        return first

    owners = {n: m for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))}
    handles = [container.get_submodule(child).register_forward_pre_hook(enter) for child in children]
    handles += [m.register_forward_pre_hook(owner(n)) for n, m in owners.items()]
    try:
        with torch.no_grad():
            for _ in range(2):
                stamps.clear()
                start = time.perf_counter()
                model(*batch[:-1]) if loss_fn is not None else model(*batch)
                end = time.perf_counter()
    finally:
        for handle in handles:
            handle.remove()
    bounds = [start, *stamps[: len(children)], end]
    held = [0] * (len(children) + 1)
    for module_name, module in owners.items():
        segment = min(first_used.get(module_name, len(children)), len(children))
        held[segment] += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if p.requires_grad)
    seconds = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    return len(children), max(sizes, default=0), seconds, tuple(held)


def measure_compute(
    model: torch.nn.Module,
    optimizer,
    loss_fn,
    batch: tuple,
    autocast=None,
    runs: int = TIMED_RUNS,
    min_seconds: float = 0.0,
) -> ComputeTimes:
    """Forward with the loss, backward and update over at least ``runs`` timed runs after a warm-up, and as many
    more as ``min_seconds`` of timed runs take (the median run's total, split as the phases' medians split), on
    copies of the model and optimizer (the originals are untouched); the forward under ``autocast`` (a dtype) where
    given, and each phase waited for on a GPU."""
    twin, inner = copy.deepcopy((model, as_optimizer(optimizer)))
    params = [p for p in twin.parameters() if p.requires_grad]
    cuda = any(p.is_cuda for p in params)
    context = torch.autocast("cuda" if cuda else "cpu", dtype=autocast) if autocast else contextlib.nullcontext()

    def now() -> float:
        torch.cuda.synchronize() if cuda else None
        return time.perf_counter()

    timed: list[tuple[float, float, float]] = []
    run, began = 0, now()
    while run <= runs or now() - began < min_seconds:
        start = now()
        with context:
            out = twin(*batch[:-1]) if loss_fn is not None else twin(*batch)
            loss = loss_fn(out, batch[-1]) if loss_fn is not None else out
        forward = now()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        backward = now()
        for p, g in zip(params, grads):
            p.grad = g
        inner.step()
        end = now()
        if run:
            timed.append((forward - start, backward - forward, end - backward))
        else:
            began = end  # the warm-up is not timed
        run += 1
    # the step is the median of the runs' totals, split as the phases' medians split: ranks sharing cores are
    # preempted at random points, so each phase's own median leaves out what a run lost to another rank (the
    # MLP of bench/planner.py, 4 ranks on 2 cores: its phases' medians summed to 19.5 ms in one calibration where
    # its inner steps then measured 35 ms)
    medians = [statistics.median(column) for column in zip(*timed)]
    scale = statistics.median(sum(run) for run in timed) / (sum(medians) or 1.0)
    return ComputeTimes(*(phase * scale for phase in medians))
