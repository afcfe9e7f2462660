"""What one parameter's optimizer update is in the step graph: its *chain* of nodes, in a canonical order, and
whether it is element-wise.

Not a pass. ``flatten-update`` runs the chains of a run of parameters once on flat buffers, which needs them
element-wise (:func:`trace_chain`); ``foreach-update`` runs the chains that stay per parameter as one
multi-tensor op per position, which only needs them to be the same op for op (:func:`collect` and
:meth:`Keys.signature`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from transpiler.graph.edit import position
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram
from transpiler.graph.views import is_view

from .gradient_flow import input_nodes

aten = torch.ops.aten
# not tagged pointwise, yet element for element: copies and factories shaped like their input (flatten-update's
# proof and shard-optimizer's check of what a slice may run)
SHAPE_FOLLOWING = frozenset(
    {
        aten.clone.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.empty_like.default,
        aten._to_copy.default,
        aten.lift_fresh_copy.default,
        aten.copy.default,
        aten.alias.default,
    }
)
# ops on Python numbers (the generic path's bias corrections, traced symbolically), and reading one
SCALAR_OPS = frozenset(
    [aten._local_scalar_dense.default, torch.sym_float, torch.sym_min, torch.sym_max, torch._sym_sqrt]
    + [getattr(operator, name) for name in ("add", "sub", "mul", "truediv", "pow", "neg", "floordiv", "mod")]
)
# kernels whose vectorised body and scalar tail round differently for these dtypes (measured: docs/bitwise.md)
UNEVEN = {(aten.add.Tensor, torch.bfloat16), (aten.add.Tensor, torch.float16)}
# whole-tensor reductions that one value over a run answers for each parameter of it, as the zero padding does
# not change them (loss scaling's "are all gradients finite"): every parameter's summary is the run's
SUMMARIES = frozenset({aten.all.default, aten.any.default})
MANY = "*"  # what a node computed from several parameters' updates belongs to


@dataclass
class Chain:
    """One parameter's update: its sources and the optimizer nodes computed from them, in graph order."""

    name: str
    placeholder: fx.Node  # the parameter's own input (the forward's, whole)
    param: fx.Node  # what the update reads of it: the input, or this rank's slice of it (a sharded optimizer)
    grad: fx.Node
    states: dict[str, fx.Node]  # state key -> its input
    held: tuple[int, int]  # the parameter's elements the update covers
    at: int  # where they start in the flat gradients
    nodes: list[fx.Node] = field(default_factory=list)
    outputs: dict[tuple[str, str], fx.Node] = field(default_factory=dict)  # (kind, key) -> value written back
    summaries: list[int] = field(default_factory=list)  # positions in nodes of SUMMARIES read outside the chain
    signature: tuple = ()

    def sources(self) -> dict[fx.Node, tuple]:
        """What the update reads of this parameter's own, keyed by kind (its structural name in a signature)."""
        return {self.param: ("param",), self.grad: ("grad",), **{s: ("state", k) for k, s in self.states.items()}}


def reach_of(program: StepProgram, grads: dict[str, fx.Node]) -> dict[fx.Node, str]:
    """Which parameter's update each node belongs to: the parameter whose own inputs, state or gradient (the
    node the update reads, ``grads``) it is computed from, or :data:`MANY` if from several (a global norm, the
    loss scale's overflow flag), or absent if from none. A value from several is shared: it does not make a node
    of one parameter's update belong to several."""
    sources: dict[fx.Node, str] = {}
    placeholders = input_nodes(program)
    for port in program.inputs:
        if port.kind in ("param", "state"):
            sources[placeholders[port]] = port.name.rsplit(".", 1)[0] if port.kind == "state" else port.name
    sources.update({grad: name for name, grad in grads.items()})
    reach: dict[fx.Node, str] = {}
    for node in program.graph.nodes:
        if node in sources:
            reach[node] = sources[node]
            continue
        found = {reach[i] for i in node.all_input_nodes if i in reach}
        own = found - {MANY}
        if len(own) == 1:
            reach[node] = own.pop()
        elif own or found:
            reach[node] = MANY
    return reach


def chain_of(
    program: StepProgram, name: str, grad: fx.Node, held: tuple[int, int] | None = None, at: int = 0
) -> Chain | str:
    """Parameter ``name``'s update, whose gradient the optimizer reads at ``grad``, or why it has none. ``held``:
    the parameter's elements it must cover (``at`` in the flat gradients), or None for whatever it reads."""
    ports = {p.name: p for p in program.inputs if p.kind in ("param", "state")}
    if Port("param", name) not in ports.values():
        return f"'{name}' is not a parameter input of the program"
    placeholders = input_nodes(program)
    placeholder = placeholders[Port("param", name)]
    param = _shard_read(placeholder, name) or placeholder  # a sharded update reads its slice
    held = held or (0, param.meta["val"].numel())
    if param.meta["val"].numel() != held[1] - held[0]:
        return f"the update of '{name}' does not read its elements {list(held)}"
    keys = [p.name.rsplit(".", 1)[1] for p in ports.values() if p.kind == "state" and p.name.startswith(name + ".")]
    states = {key: placeholders[ports[f"{name}.{key}"]] for key in keys}
    return Chain(name, placeholder, param, grad, states, held, at)


def _shard_read(placeholder: fx.Node, name: str) -> fx.Node | None:
    """The node through which a sharded update reads its slice of the parameter (``meta["shard_of"]``)."""
    stack = list(placeholder.users)
    while stack:
        node = stack.pop()
        if node.meta.get("shard_of") == name:
            return node
        if is_view(node):
            stack.extend(node.users)
    return None


def dtype_device(node: fx.Node) -> tuple[str, str]:
    val = node.meta["val"]
    return str(val.dtype).removeprefix("torch."), str(val.device)


def collect(chain: Chain, reach: dict[fx.Node, str]) -> Keys:
    """Fill ``chain.nodes``: the optimizer nodes computed from its sources and from no other parameter's, in the
    canonical order of the returned keys."""
    member: set[fx.Node] = set()
    frontier = [u for s in chain.sources() for u in s.users]
    while frontier:
        node = frontier.pop()
        if node in member or node.op != "call_function" or node.meta.get("role") != "optimizer":
            continue
        if any(reach.get(i, chain.name) not in (chain.name, MANY) for i in node.all_input_nodes):
            continue  # it also reads another parameter's update: a global value (a norm, a flag), not this chain
        member.add(node)
        frontier.extend(node.users)
    keys = Keys(chain.sources(), reach)
    chain.nodes = keys.canonical(member, position(chain.param.graph))
    return keys


def trace_chain(chain: Chain, outputs: dict[Port, fx.Node], reach: dict[fx.Node, str]) -> str:
    """Fill ``chain.nodes`` and ``chain.outputs``; check that the chain is element-wise and that nothing outside
    it reads its intermediate values, so that it can run on a flat range. Returns why not, or ''."""
    keys = collect(chain, reach)
    member, sources = set(chain.nodes), chain.sources()
    wanted = {Port("param", chain.name): ("param", "")} | {
        Port("state", f"{chain.name}.{k}"): ("state", k) for k in chain.states
    }
    for port, value in outputs.items():
        if port in wanted:
            chain.outputs[wanted[port]] = value
        elif port.kind == "state" and port.name.rsplit(".", 1)[0] == chain.name:
            return f"'{port.name}' is an output without an input"
    if set(chain.outputs) != set(wanted.values()):
        return f"'{chain.name}' has no output for its parameter or some of its state"
    for value in chain.outputs.values():
        if value not in member and value not in sources:
            return f"'{chain.name}''s new value is not computed by its update"
    written = set(chain.outputs.values())
    for i, node in enumerate(chain.nodes):
        outside = [u for u in node.users if u not in member and not (u.op == "output" and node in written)]
        if outside and node.target in SUMMARIES and node.meta["val"].dim() == 0 and node not in written:
            chain.summaries.append(i)
        elif outside:
            return f"'{outside[0].name}' reads '{node.name}' of '{chain.name}''s update"
    why = _elementwise(chain, sources)
    if not why:
        chain.signature = keys.signature(chain)
    return why


def kind_of(node: fx.Node, shape: torch.Size) -> str:
    """``tensor`` (shaped as the parameter), ``lane`` (0-d), ``scalar`` (a Python number) or ``other``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor" if val.shape == shape else "lane" if val.dim() == 0 else "other"
    return "scalar" if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)) else "other"


def _elementwise(chain: Chain, sources: dict[fx.Node, tuple]) -> str:
    """'' if every op of the chain is element-wise in the parameter's elements; else why not."""
    shape = chain.param.meta["val"].shape
    for key, state in chain.states.items():
        if kind_of(state, shape) not in ("tensor", "lane"):
            return f"state '{key}' of '{chain.name}' is neither shaped as the parameter nor 0-d"
    own = set(chain.nodes) | set(sources)
    for node in chain.nodes:
        kind = kind_of(node, shape)
        inputs = [kind_of(i, shape) for i in node.all_input_nodes]
        foreign = [i.name for i, k in zip(node.all_input_nodes, inputs) if k == "tensor" and i not in own]
        if foreign:  # a tensor shaped as the parameter that its update did not make (a renormed Embedding table)
            return f"'{node.name}' in the update of '{chain.name}' reads '{foreign[0]}', which is not flat"
        dtype = node.meta["val"].dtype if isinstance(node.meta.get("val"), torch.Tensor) else None
        if (node.target, dtype) in UNEVEN and kind == "tensor":
            return f"{node.target} on {dtype} rounds differently in a flat buffer"
        if kind == "scalar" and node.target in SCALAR_OPS and "tensor" not in inputs:
            continue
        pointwise = torch.Tag.pointwise in getattr(node.target, "tags", ()) or node.target in SHAPE_FOLLOWING
        pointwise |= node.target in SUMMARIES and chain.nodes.index(node) in chain.summaries
        if not pointwise or kind not in ("tensor", "lane") or "other" in inputs:
            return f"'{node.name}' ({node.target}) in the update of '{chain.name}' is not element-wise"
        if kind == "lane" and "tensor" in inputs and node.target not in SUMMARIES:
            return f"'{node.name}' reduces '{chain.name}''s elements to one value"
    return ""


class Keys:
    """Structural names for a chain's nodes: its own nodes by their index, its sources by kind, a value of several
    parameters by node (one value for all), a value of none by structure (the generic path traces ``-lr`` once
    per parameter). Two chains with the same keys, op for op, are one update."""

    def __init__(self, sources: dict[fx.Node, tuple], reach: dict[fx.Node, str]):
        self.sources, self.reach = sources, reach
        self.index: dict[fx.Node, int] = {}
        self._shared: dict[fx.Node, tuple] = {}

    def node(self, node: fx.Node) -> tuple:
        return str(node.target), self.key(node.args), self.key(node.kwargs)

    def key(self, value: object, depth: int = 0) -> object:
        if isinstance(value, fx.Node):
            if value in self.index:
                return ("chain", self.index[value])
            if value in self.sources:
                return ("source", *self.sources[value])
            if value not in self._shared:
                if value.op != "call_function" or depth > 8 or value in self.reach:
                    self._shared[value] = ("node", value.name)
                else:
                    self._shared[value] = ("op", *self.node(value))
            return self._shared[value]
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *(self.key(v, depth + 1) for v in value))
        if isinstance(value, dict):
            return tuple((k, self.key(v, depth + 1)) for k, v in sorted(value.items()))
        if isinstance(value, float):
            return ("float", value.hex())
        return (type(value).__name__, repr(value))

    def canonical(self, members: set[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
        """The chain in an order that does not depend on where passes placed independent ops: by depth from the
        sources, then by key (a topological order, the same for every parameter's chain)."""
        depth: dict[fx.Node, int] = {}
        for node in sorted(members, key=order.__getitem__):
            depth[node] = 1 + max((depth[i] for i in node.all_input_nodes if i in depth), default=0)
        nodes: list[fx.Node] = []
        for level in sorted(set(depth.values())):
            for node in sorted((n for n in members if depth[n] == level), key=lambda n: (repr(self.node(n)), order[n])):
                self.index[node] = len(nodes)
                nodes.append(node)
        return nodes

    def signature(self, chain: Chain) -> tuple:
        body = tuple(self.node(n) for n in chain.nodes)
        writes = tuple(sorted((k, self.key(v)) for k, v in chain.outputs.items()))
        kinds = tuple(sorted((k, s.meta["val"].dim() == 0) for k, s in chain.states.items()))
        return body, writes, tuple(chain.summaries), kinds, dtype_device(chain.param)


def runs_of(chains: list[Chain]) -> list[list[Chain]]:
    """Consecutive parameters (in slot order) whose updates are the same chain."""
    runs: list[list[Chain]] = []
    for chain in chains:
        if runs and runs[-1][-1].signature == chain.signature:
            runs[-1].append(chain)
        else:
            runs.append([chain])
    return runs
