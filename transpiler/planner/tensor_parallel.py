"""What a tensor-parallel plan does to the step, read from the model and the user's plan, for the planner to price
``tp`` degrees (a group of ``tp`` ranks of one host splitting the planned layers, a data-parallel mode across the
``dp = W / tp`` groups, as docs/strategies/tensor_parallel.md builds it).

The plan is the dict ``parallelize_module`` takes (module names, ``*`` matching one level, to torch's
``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``...). Nothing is traced on a mesh: one eager forward
with hooks on the linear and embedding layers gives

- **the split parameters**: a column-split layer's weight and bias, a row-split layer's weight (its bias stays
  whole), each held 1/tp per rank, with its gradient and optimizer state;
- **the split work**: the planned linear layers' share of all linear layers' multiply-adds (output elements ×
  input features). The step's measured forward and backward are taken to split by that share (the pointwise
  work and attention's own matmuls between split layers go with them, as a head split divides them too): each
  rank runs the share 1/tp and the rest whole;
- **the exchanges**, collective by collective as DTensor makes them for each style (a ring moves ``(n−1)/n`` of
  the bytes in an all-gather or a reduce-scatter, twice that in an all-reduce), per example batch:

  - a row-split layer whose output is made whole all-reduces it in the forward, and a linear one the same size
    again in the backward (the input gradient of the column-split layers before it);
  - a row-split layer whose output stays split along the sequence reduce-scatters it forward and all-gathers its
    gradient backward;
  - a column-split layer whose output is made whole (a head) all-gathers it forward (and a sequence-split input
    first), and all-reduces its input's gradient backward (reduce-scatters, where the input came split);
  - an input prepared from a sequence split to whole is all-gathered forward, its gradient reduce-scattered
    backward;
  - sequence-parallel parameters (a norm's) have their gradients all-reduced in the backward (a few hundred
    bytes, counted as the others are).

A ``tp`` group takes ``tp`` example batches (every layout trains W of them per step), so a rank computes
``tp × (1 − s + s / tp)`` of one batch's forward and backward for a split share ``s``: tensor parallelism pays on
this count only where the split share is near one, or where a model does not fit otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import torch
from torch import nn

from transpiler.errors import ConfigurationError

from .cluster import Cluster, ring

if TYPE_CHECKING:
    from .profile import StepProfile


@dataclass(frozen=True)
class TensorParallelShape:
    """A plan's effect on one rank's step (module docstring): the trainable parameters it splits, the share of the
    linear work it splits, and the exchanges over ``tp`` per example batch as ``(kind, bytes)``."""

    sharded: frozenset[str]
    split_share: float
    exchanges: tuple[tuple[str, int], ...]

    def seconds(self, cluster: Cluster, tp: int) -> float:
        """The exchanges of a step of ``tp`` example batches over a group of ``tp`` ranks of one host."""
        return sum(cluster.collective_seconds(kind, size * tp, tp) for kind, size in self.exchanges)

    @property
    def gathered(self) -> int:
        """Bytes per example batch that an all-gather makes whole (a prepared input, a head's output): held whole,
        not 1/tp, on every rank of the group."""
        return sum(size for kind, size in self.exchanges if kind == "all_gather")

    def sent(self, tp: int) -> float:
        """Bytes a rank sends over ``tp`` per step (a ring's share of each exchange)."""
        return sum(ring(kind, tp)[1] * size * tp for kind, size in self.exchanges)


def tensor_parallel_shape(model: nn.Module, plan: dict, loss_fn, batch: tuple) -> TensorParallelShape:
    """Read the plan against the model with one eager forward on no gradient (module docstring)."""
    styles = _styles(model, plan)
    names = {module: name for name, module in model.named_modules()}
    work = {"split": 0, "all": 0}
    exchanges: list[tuple[str, int]] = []

    def seen(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        style = styles.get(names[module])
        if isinstance(module, nn.Linear):
            work["all"] += output.numel() * module.in_features
            work["split"] += output.numel() * module.in_features if type(style).__name__ in _SPLITS else 0
        if style is not None:
            exchanges.extend(_exchanges(module, style, _bytes(args[0]), _bytes(output)))

    watched = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    watched += [model.get_submodule(name) for name in styles]
    handles = [m.register_forward_hook(seen) for m in dict.fromkeys(watched)]
    try:
        with torch.no_grad():
            model(*batch[:-1]) if loss_fn is not None else model(*batch)
    finally:
        for handle in handles:
            handle.remove()
    return TensorParallelShape(
        sharded=frozenset(_sharded(model, styles)),
        split_share=work["split"] / work["all"] if work["all"] else 0.0,
        exchanges=tuple(exchanges),
    )


def _exchanges(module: nn.Module, style: object, given: int, made: int) -> list[tuple[str, int]]:
    """One module's collectives per example batch by its style (module docstring's table), as (kind, bytes)."""
    kind = type(style).__name__
    if kind == "RowwiseParallel":
        if _split(style.output_layouts):
            return [("reduce_scatter", made), ("all_gather", made)]
        return [("all_reduce", made)] * (2 if isinstance(module, nn.Linear) else 1)
    if kind == "ColwiseParallel" and not _split(style.output_layouts):
        if _split(style.input_layouts):
            return [("all_gather", given), ("all_gather", made), ("reduce_scatter", given)]
        return [("all_gather", made), ("all_reduce", given)]
    if kind == "PrepareModuleInput" and _split(style.input_layouts) and not _split(style.desired_input_layouts):
        return [("all_gather", given), ("reduce_scatter", given)]
    if kind == "SequenceParallel":
        return [("all_reduce", sum(_bytes(p) for p in module.parameters() if p.requires_grad))]
    return []


def _split(layouts) -> bool:
    return any(type(layout).__name__ == "Shard" for layout in layouts or ())


def _bytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


_SPLITS = ("ColwiseParallel", "RowwiseParallel")


def _styles(model: nn.Module, plan: dict) -> dict[str, object]:
    """The style of each module the plan names (``*`` matching one level of the name, as parallelize_module
    reads it); an error for a key that names no module."""
    if not isinstance(plan, dict) or not plan:
        raise ConfigurationError(
            "tp_plan is the dict parallelize_module takes: module names to ColwiseParallel, RowwiseParallel, ..."
        )
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, object] = {}
    for pattern, style in plan.items():
        matched = [n for n in names if n.count(".") == pattern.count(".") and fnmatchcase(n, pattern)]
        if not matched:
            raise ConfigurationError(f"tp_plan names {pattern!r}, which is no module of the model.")
        styles.update(dict.fromkeys(matched, style))
    return styles


def _sharded(model: nn.Module, styles: dict[str, object]) -> set[str]:
    out = set()
    for name, style in styles.items():
        kind = type(style).__name__
        if kind not in _SPLITS:
            continue
        module = model.get_submodule(name)
        kept = ("weight", "bias") if kind == "ColwiseParallel" or isinstance(module, nn.Embedding) else ("weight",)
        out |= {f"{name}.{p}" for p, v in module.named_parameters(recurse=False) if p in kept and v.requires_grad}
    return out


def split_profile(profile: StepProfile, tp: int) -> StepProfile:
    """The profile one rank of a ``tp`` group sees (module docstring): its shares of the split parameters, their
    gradients and optimizer state, ``tp`` example batches of work, activations and batch, where what an all-gather
    made whole is held whole."""
    shape = profile.tensor_parallel
    per_batch = 1 - shape.split_share + shape.split_share / tp
    parameters = tuple((n, size // tp if n in shape.sharded else size) for n, size in profile.parameters)
    kept = sum(size for _, size in parameters) / profile.parameter_bytes
    times = profile.compute
    return dataclasses.replace(
        profile,
        parameters=parameters,
        state_bytes=int(profile.state_bytes * kept),
        batch_bytes=profile.batch_bytes * tp,
        batch_size=profile.batch_size * tp,
        transient=int(profile.transient * tp * per_batch + shape.gathered * tp * (1 - 1 / tp)),
        recompute=(),
        largest_module_bytes=int(profile.largest_module_bytes * kept),
        compute=dataclasses.replace(
            times,
            forward=times.forward * tp * per_batch,
            backward=times.backward * tp * per_batch,
            update=times.update * kept,
        ),
        tensor_parallel=None,
    )
