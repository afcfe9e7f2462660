"""How many bytes a program's own tensors hold at once while it runs, from its schedule.

A GraphModule's code drops every value after its last reader (``x = None``), so the tensors alive after a node
are those made by it or before it that something later still reads. A node makes a new tensor unless its op
returns an alias of an input (views, in-place ops, ``out=`` forms, ``wait_tensor``) or nothing (in-place
multi-tensor ops); an alias keeps its base alive. Inputs and constants are held by the runtime and not counted
here. The values are the fake tensors each node carries, whose shapes and dtypes are the real ones, so this is
the program's own count of what it allocates, in its order (the CUDA allocator's measured peak is reported
beside it on a GPU).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx

from .collectives import WAIT, is_collective
from .program import StepProgram


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s result shares, or None when the op allocates its result."""
    if node.target is operator.getitem or node.target is WAIT:
        return node.args[0]
    if "out" in node.kwargs:
        return node.kwargs["out"]
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias_set = schema.returns[0].alias_info.before_set
    if not alias_set and node.target.is_view:  # a list of views (``split``, ``unbind``): ``Tensor(a)[]``
        alias_set = next((a.alias_info.before_set for a in schema.arguments if a.alias_info is not None), set())
    for argument, value in zip(schema.arguments, node.args):
        if argument.alias_info is not None and argument.alias_info.before_set & alias_set:
            return value if isinstance(value, fx.Node) else None
    return None


def _returns_nothing(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.returns


def _bytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(value))


def tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors in a node's value (one, or those of a tuple or list of them, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


class Slot(NamedTuple):
    """One op of a schedule, as liveness sees it: the slots it reads (their positions), the slot whose storage
    its result lives in (``alias``; None: it allocates ``size`` bytes, or makes no tensor), and its role (a
    collective's is ``communication``). A
    named tuple: the recompute pass builds a schedule per candidate it weighs."""

    reads: tuple[int, ...]
    alias: int | None
    size: int
    role: str = ""
    scratch: int = 0  # bytes the op holds only while it runs (a convolution backward's workspace)


@dataclass(frozen=True)
class Liveness:
    """What a schedule holds at once: its peak, where it is, and the bytes alive there by the role of the op that
    allocated them (``forward`` values alive at a backward peak are the activations kept for it)."""

    peak: int
    at: int
    by_role: dict[str, int]
    after_forward: int  # the bytes alive once the forward (and the loss) has run: what it keeps for the backward


def slots_of(
    nodes: list[fx.Node], counted: Callable[[fx.Node], bool] | None = None, scratch: dict[str, int] | None = None
) -> list[Slot]:
    """The schedule of ``nodes`` (a graph's, in order); with ``counted``, only the allocations of the nodes it
    accepts have a size. Inputs and constants are held by the runtime: they are read, never counted. Each
    output of an op with several (``native_batch_norm``'s output and statistics) is its own allocation, made
    where it is taken out (``getitem``, right after the op) and alive while it is read: the tuple itself dies
    at once in a GraphModule's code. ``scratch`` (:func:`scratch_key` -> bytes, measured by the runtime) adds
    what an op holds only while it runs."""
    index = {node: i for i, node in enumerate(nodes)}
    out = []
    for node in nodes:
        reads = tuple(index[a] for a in node.all_input_nodes)
        role = "communication" if is_collective(node) else node.meta.get("role", "")
        held = scratch.get(scratch_key(node) or "", 0) if scratch else 0
        if _makes_several(node):  # its outputs exist together while it runs, then each as its getitem keeps it
            out.append(Slot(reads, None, 0, role, held + _bytes(node.meta.get("val"))))
            continue
        if node.op != "call_function" or _returns_nothing(node):
            out.append(Slot(reads, None, 0, role, held))
            continue
        alias = _aliased_input(node)
        made_by = alias if alias is not None and _makes_several(alias) else node
        if alias is not None and made_by is node:
            out.append(Slot(reads, index[alias], 0, role, held))
        else:
            size = _bytes(node.meta.get("val")) if counted is None or counted(made_by) else 0
            out.append(Slot(reads, None, size, role, held))
    return out


# ops that hold memory of their own while they run (oneDNN's convolution and norm kernels, attention): measured
# once per call signature by the runtime (``runtime/op_scratch.py``), the rest allocate only their outputs
SCRATCH_FAMILIES = ("convolution", "batch_norm", "layer_norm", "group_norm", "scaled_dot_product", "attention")


def scratch_key(node: fx.Node) -> str | None:
    """What identifies an op's scratch: its name and every argument (tensors by shape, stride and dtype), or None
    for an op outside :data:`SCRATCH_FAMILIES`."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if not any(family in target.__name__ for family in SCRATCH_FAMILIES):
        return None

    def describe(value: object) -> str:
        if isinstance(value, fx.Node):
            v = value.meta.get("val")
            if isinstance(v, torch.Tensor):
                return f"T{tuple(v.shape)}{tuple(v.stride())}{v.dtype}{v.device.type}"
            return repr(v)
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(map(describe, value)) + "]"
        return repr(value)

    return f"{target}({describe(node.args)};{describe(dict(sorted(node.kwargs.items())))})"


def _makes_several(node: fx.Node) -> bool:
    """Whether ``node`` is an op that allocates several outputs, each taken out by a ``getitem``."""
    return (
        node.op == "call_function"
        and isinstance(node.meta.get("val"), (tuple, list))
        and not _returns_nothing(node)
        and _aliased_input(node) is None
    )


FORWARD_ROLES = ("forward", "loss")


def liveness(slots: list[Slot]) -> Liveness:
    """Each allocation lives from its op to the last read of it or of any alias of it (a GraphModule's code drops
    every value after its last reader); the most bytes alive at once, and what they are."""
    root: list[int | None] = []
    last: dict[int, int] = {}
    for i, slot in enumerate(slots):
        for r in slot.reads:
            base = root[r]
            if base is not None:
                last[base] = i
        if slot.alias is not None:
            root.append(root[slot.alias])
        elif slot.size:
            root.append(i)
            last.setdefault(i, i)
        else:
            root.append(None)
    frees: dict[int, int] = {}
    for base, end in last.items():
        frees[end] = frees.get(end, 0) + slots[base].size
    live = peak = at = after_forward = 0
    forward_ends = max((i for i, s in enumerate(slots) if s.role in FORWARD_ROLES), default=-1)
    for i, slot in enumerate(slots):
        if root[i] == i:
            live += slot.size
        if live + slot.scratch > peak:
            peak, at = live + slot.scratch, i
        live -= frees.get(i, 0)
        if i == forward_ends:
            after_forward = live
    by_role: dict[str, int] = {}
    for base, end in last.items():
        if base <= at <= end:
            by_role[slots[base].role] = by_role.get(slots[base].role, 0) + slots[base].size
    if slots and slots[at].scratch:
        by_role["scratch"] = slots[at].scratch
    return Liveness(peak, at, by_role, after_forward)


def peak_transient_bytes(graph: fx.Graph, counted: Callable[[fx.Node], bool] | None = None) -> int:
    """The most bytes of tensors the program itself allocated that are alive at once (inputs not counted);
    with ``counted``, of those allocated by the nodes it accepts (ZeRO-3's gathered buckets, say)."""
    return liveness(slots_of(list(graph.nodes), counted)).peak


def largest_allocation_bytes(graph: fx.Graph) -> int:
    """The bytes of the largest single tensor the program allocates (an all-gathered bucket, a gradient)."""
    sizes = [
        _bytes(value)
        for node in graph.nodes
        if node.op == "call_function" and _aliased_input(node) is None
        for value in tensors_of(node.meta.get("val"))
    ]
    return max(sizes, default=0)


_HELD = {"param": "parameters", "frozen": "parameters", "buffer": "parameters", "state": "optimizer_state"}
_MADE = {
    "forward": "activations",
    "loss": "activations",
    "communication": "communication",
    "optimizer": "update",
    "scratch": "scratch",
}


@dataclass(frozen=True)
class MemoryEstimate:
    """A program's bytes by its schedule, before it runs: what the rank holds as the program's inputs and
    constants (parameters and buffers, persistent gradient buckets, optimizer state, the state passes added, the
    batch), and the program's own tensors at their peak, by what made the ones alive there: the forward's
    activations kept for the backward, the backward's gradients and temporaries, communication buffers, the
    update's temporaries. ``peak`` is their sum: the step's peak as the schedule predicts it."""

    parameters: int
    gradients: int
    optimizer_state: int
    transpiler_state: int
    batch: int
    activations: int
    backward: int
    communication: int
    update: int
    scratch: int = 0

    @property
    def held(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.transpiler_state

    @property
    def transient(self) -> int:
        """The program's own tensors at their peak (what a ``memory_budget`` bounds)."""
        return self.activations + self.backward + self.communication + self.update + self.scratch

    @property
    def peak(self) -> int:
        return self.held + self.batch + self.transient

    def __str__(self) -> str:
        return mib_table(
            [
                ("parameters and buffers", self.parameters),
                ("gradient buckets", self.gradients),
                ("optimizer state", self.optimizer_state),
                ("transpiler state", self.transpiler_state),
                ("batch", self.batch),
                ("at the step's peak: activations kept", self.activations),
                ("  backward gradients and temporaries", self.backward),
                ("  communication buffers", self.communication),
                ("  update temporaries", self.update),
                ("  the op's own scratch (measured)", self.scratch),
                ("peak of the step (estimated)", self.peak),
            ],
            width=40,
        )


def mib_table(rows: list[tuple[str, int]], width: int) -> str:
    """Named byte counts as lines of MiB, the names padded to ``width`` (``memory_report()``, the estimate)."""
    return "\n".join(f"{name:<{width}} {value / (1024 * 1024):10.3f} MiB" for name, value in rows)


def memory_estimate(program: StepProgram) -> MemoryEstimate:
    """The estimate of a program, rewritten, from its ports, constants and schedule, with the scratch of its ops
    the runtime measured (``program.op_scratch``)."""
    graph = program.graph
    flat = {buffer.port: buffer.kind for buffer in program.flat_buffers}  # flat parameters, flat state
    held = dict.fromkeys(("parameters", "gradients", "optimizer_state", "transpiler_state", "batch"), 0)
    for node in graph.nodes:
        if node.op == "placeholder" and "port" in node.meta:
            port = node.meta["port"]
            kind = flat.get(port.name, str(port.kind)) if port.kind == "flat" else str(port.kind)
            where = _HELD.get(kind, "batch" if kind == "batch" else "transpiler_state")
            held[where] += _bytes(node.meta.get("val"))
        elif node.op == "get_attr":
            value = getattr(graph.owning_module, node.target, None)
            held["gradients" if node.meta.get("bucket") is not None else "transpiler_state"] += _bytes(value)
    made = dict.fromkeys(("activations", "backward", "communication", "update", "scratch"), 0)
    for role, size in liveness(slots_of(list(graph.nodes), scratch=program.op_scratch)).by_role.items():
        made[_MADE.get(role, "backward")] += size
    return MemoryEstimate(**held, **made)
