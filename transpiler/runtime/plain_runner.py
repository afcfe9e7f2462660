"""What runs the uncompiled, uncaptured step: its program's graph, with rewrites that leave every bit as it was.

On every device the copy that runs calls each operator's C++ entry directly (:func:`direct_calls`): the program's
generated code calls ``torch.ops.aten.mm.default(...)``, a Python method (``OpOverload.__call__``) that only
forwards to ``OpOverload._op``, so every op of the step pushed a Python frame. Beside the call itself, CPython 3.11
keeps frames in 16 KiB chunks that it maps and unmaps as the stack crosses them; the generated ``forward`` of a
program of 1,400 nodes fills most of a chunk by itself, and where it happened to leave less room than an op's
frame, every op of the step mapped a chunk and unmapped it again (``mmap``/``munmap``, page faults, TLB shootdowns
to the process's other threads). Which case a process fell into depended on how deep its stack was when the step
ran (running the same bench as ``__main__`` or through ``runpy`` flipped it): the narrow GPT's flat programs ran at
2-3x their step time in some runs of ``python -m bench.peers`` (docs/performance.md). A C++ entry pushes no frame.

On a GPU the uncompiled step is host-bound where its kernels are small: every op costs the host a dispatch, a
non-view op a kernel launch too. The program (dumps, verifiers, checkpoints, the cost model) keeps every node;
:func:`plain_runner` returns a copy of its graph module that runs fewer:

- **copies that cast**: ``copy_(dst, _to_copy(x, dtype=dst's))`` where nothing else reads the cast becomes
  ``copy_(dst, x)``, since ``copy_`` converts the dtype itself with the same conversion (``_to_copy`` is an
  allocation and a ``copy_``). Under autocast each bfloat16 weight gradient is cast to float32 and copied into
  its bucket slot: 96 ops and temporaries a step fewer on GPT-2.
- **constants**: a node that reads no input of the step is computed once, here, and becomes an attribute: a view
  of a persistent bucket buffer (one ``as_strided`` per gradient slot, 148 on GPT-2) and the model's own
  constants (transformers' causal mask: ``arange``, ``scalar_tensor``, ``where``...). An aten op that is not
  random, writes nothing, and reads only constants (``get_attr`` attributes, folded nodes) folds. A view of a
  persistent buffer aliases it as the unfolded step's view does, so it folds even where a later op writes through
  it (``mm.out`` into a gradient slot). Any other op's result would become one tensor shared by every step
  instead of a fresh one per step, so it folds only where nothing writes to it or through a view of it, it reads
  no attribute (the step may write those), nothing returns it, and it is at most :data:`MAX_FOLDED_BYTES`.

Inductor does both itself under ``compile=True``, and a captured step replays its kernels without the host, so
only the plain runner rewrites. It casts and folds on a GPU only (:func:`runs_on_gpu`), where that gain is
measured (docs/gpu.md); on the CPU it is not measured.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from transpiler.graph.views import is_view

aten = torch.ops.aten
MAX_FOLDED_BYTES = 16 * 2**20  # a folded result that is not a view lives as long as the step: a mask, not a bucket


def runs_on_gpu(gm: fx.GraphModule) -> bool:
    """Whether the program's inputs live on a GPU."""
    values = (n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder")
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values)


class PlainRunner:
    """Runs a program's graph module with its ops called directly (:func:`direct_calls`) and, with ``fold`` (on a
    GPU), as :func:`plain_runner` rewrites it; the rewrite made on first use: a program built and never run (every
    rank's, built in one process for a static check) costs no more to build."""

    def __init__(self, program_module: fx.GraphModule, fold: bool = False) -> None:
        self.program_module = program_module
        self.fold = fold
        self._module: fx.GraphModule | None = None

    @property
    def module(self) -> fx.GraphModule:
        """The graph module that runs (its generated code is what a failure's traceback shows)."""
        if self._module is None:
            self._module = direct_calls(plain_runner(self.program_module) if self.fold else self.program_module)
        return self._module

    def __call__(self, *inputs) -> tuple:
        # its generated forward itself: the module's call wrapper (torch.fx's _WrappedCall) drops the traceback of
        # an error raised on a line of that code, which now calls C++ directly, and the node it names is lost
        return self.module.forward(*inputs)


def plain_runner(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its casting copies fused and its constant nodes computed once (``gm`` itself where neither
    applies). The new module holds ``gm``'s attributes, the same tensors, and the folded values."""
    casts = [n for n in gm.graph.nodes if _cast_copied(n) is not None]
    plan = _foldable(gm.graph)
    if not plan and not casts:
        return gm
    graph, copies = _graph_copy(gm)
    for cast in casts:
        twin = copies[cast]
        (user,) = twin.users
        user.replace_input_with(twin, twin.args[0])
        graph.erase_node(twin)
    attrs = {n.target: _attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    values = _evaluate(attrs, plan)
    for i, node in enumerate(plan):
        if all(u in plan for u in node.users):
            continue
        name = f"_folded_{i}"
        while name in attrs:
            name += "_"
        attrs[name] = values[node]
        twin = copies[node]
        with graph.inserting_before(twin):
            attr = graph.get_attr(name)
        attr.meta = dict(twin.meta)
        twin.replace_all_uses_with(attr)
    for node in reversed(plan):  # the folded nodes no one reads now (not a general dead-code pass: side effects)
        if not copies[node].users:
            graph.erase_node(copies[node])
    return fx.GraphModule(attrs, graph, class_name=type(gm).__name__)


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (the same attributes) whose generated code calls each operator's C++ entry
    (``OpOverload._op``) instead of the ``OpOverload``, which pushes a Python frame only to call it (module
    docstring). The copy's nodes keep their ``OpOverload`` targets, so a failure names the node as the program's
    does; only its code, generated with a stand-in per operator, finds the C++ entry under that name."""
    graph, _ = _graph_copy(gm)
    ops = {n: n.target for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    stand_ins = {op: _stand_in(op) for op in dict.fromkeys(ops.values())}
    for node, op in ops.items():
        node.target = stand_ins[op]
    module = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for node, op in ops.items():
        node.target = op
    entries = {id(stand_in): op._op for op, stand_in in stand_ins.items()}
    scope = type(module).forward.__globals__
    for name, value in list(scope.items()):
        scope[name] = entries.get(id(value), value)
    return module


def _graph_copy(gm: fx.GraphModule) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of ``gm``'s graph, its code generator included, and each node's copy."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    return graph, copies


def _stand_in(op: torch._ops.OpOverload) -> Callable:
    """A function named after ``op`` for the code generator to call; :func:`direct_calls` binds its name to
    ``op``'s C++ entry in the generated code's globals, so it is called only where that binding is undone."""

    def stand_in(*args, **kwargs):
        return op(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = str(op).replace(".", "_").replace("::", "_")
    return stand_in


def _cast_copied(node: fx.Node) -> fx.Node | None:
    """The ``copy_`` that alone reads ``node``, where ``node`` is a plain cast to that copy's destination dtype on
    its input's device; else None."""
    if node.target is not aten._to_copy.default or len(node.args) != 1 or len(node.users) != 1:
        return None
    if set(node.kwargs) - {"dtype", "layout", "device"} or node.kwargs.get("layout", torch.strided) != torch.strided:
        return None
    (user,) = node.users
    if user.target is not aten.copy_.default or user.args[0] is node or user.args[1] is not node:
        return None
    source, dest = node.args[0], user.args[0]
    values = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in (source, dest, node)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    value, dest_value, cast = values
    if value.layout != torch.strided or cast.dtype != dest_value.dtype or value.device != cast.device:
        return None
    return user


def _foldable(graph: fx.Graph) -> list[fx.Node]:
    """The nodes to fold, in graph order."""
    constant: set[fx.Node] = set()
    reads_attr: set[fx.Node] = set()  # computed from a get_attr: foldable as views only
    order = []
    for node in graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
            reads_attr.add(node)
            continue
        if node.op != "call_function" or not _pure(node) or not all(a in constant for a in node.all_input_nodes):
            continue
        from_attr = any(a in reads_attr for a in node.all_input_nodes)
        view = node.target is operator.getitem or is_view(node)
        if not view and (from_attr or _written_or_returned(node) or _nbytes(node) > MAX_FOLDED_BYTES):
            continue
        constant.add(node)
        if from_attr:
            reads_attr.add(node)
        order.append(node)
    return order


def _pure(node: fx.Node) -> bool:
    """An aten op (or ``getitem`` of one's results) that neither writes its arguments nor draws random numbers."""
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _written_or_returned(node: fx.Node) -> bool:
    """Whether an op writes ``node``'s result (or a view of it) or the graph returns it."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                return True
            if user.target is operator.getitem or is_view(user):
                stack.append(user)
            elif not isinstance(user.target, torch._ops.OpOverload) or user.target._schema.is_mutable:
                return True  # writes it, or a call that cannot be seen into
    return False


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    values = value if isinstance(value, list | tuple) else [value]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return MAX_FOLDED_BYTES + 1  # unknown: not folded
    return sum(v.numel() * v.element_size() for v in values)


def _evaluate(attrs: dict[str, object], plan: list[fx.Node]) -> dict[fx.Node, object]:
    """The folded nodes' values, computed from the module's attributes ``attrs``."""
    values: dict[fx.Node, object] = {}
    for node in plan:
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                values[a] = attrs[a.target]
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        with torch.no_grad():
            values[node] = node.target(*args, **kwargs)
    return values


def _attr(gm: fx.GraphModule, target: str) -> object:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
