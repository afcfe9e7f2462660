"""``flatten-update``: one optimizer update per bucket, on flat parameters and state.

Requires: gradients reduced in buckets whose flat result carries ``meta["flat_grads"]`` (``fuse-allreduce``
tags it: the names, starts and sizes of the bucket's slots), and the per-parameter update the optimizer was
traced into (the twins, or the generic path's own ``step()``).
Guarantees: for each such bucket,

- the bucket's parameters become views of one flat input, laid out as the gradients are (the same slot
  starts): the runtime binds each parameter's ``.data`` to its view (``program.flat_buffers``), the forward
  reads ``as_strided`` views of it, and the parameter's own input and output go;
- each *run* of parameters whose updates are the same chain of element-wise ops (one param group of one
  optimizer: the slots of a bucket are laid out group by group, ``bucketing.in_group_order``) is updated by
  that chain once, on the run's range of the flat parameters, of the reduced gradient bucket and of one flat
  buffer per optimizer-state entry (Adam's ``exp_avg`` and ``exp_avg_sq``), instead of once per parameter. A
  0-d state entry (``step``) becomes a *lane* buffer of one element per parameter: the chain runs on it
  whole, and where a value computed from it enters the element-wise part, lane 0 stands for all (every lane
  of a run holds the same count);
- the new values are written back into those ranges (``copy_``), so the program keeps no per-parameter
  output; ``reinplace-optimizer`` then runs the chain in place and drops the copies that write a value where
  it already is.

"Element-wise" is proved from the graph, never assumed from the optimizer's name: every op of the chain is
tagged pointwise (or is a copy or a ``*_like`` factory), reads tensors shaped as the parameter or 0-d values,
and nothing outside the chain reads its intermediate values; the chains of a run are the same op for op, with
the same constants and the same shared inputs (scalar slots). A bucket where any parameter's update fails
that (LAMB's norms, Adafactor's factored moments, Muon's matrices, a 0-d parameter) is left per parameter,
whole. Per element the arithmetic is the same op on the same operands, so the bits are eager's where the
kernels round alike in their vectorised body and scalar tail (``docs/bitwise.md``: float32 and float64 on
the CPUs measured; not ``add(..., alpha=)`` in bfloat16 and float16, whose buckets stay per parameter).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from transpiler.graph.bucket_layout import FLAT_GRADS, FlatGrads
from transpiler.graph.edit import Cursor, position, repair_order
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import FlatBuffer, Port, StepProgram
from transpiler.graph.views import contiguous_views, is_view

from .bucket_views import aliased_to_output, write_into_buffer
from .bucketing import in_group_order
from .gradient_flow import (
    add_input,
    input_node,
    optimizer_gradients,
    output_values,
    retarget_optimizer_input,
    set_output_values,
)

aten = torch.ops.aten
# not tagged pointwise, yet element for element: copies and factories shaped like their input
SHAPE_FOLLOWING = frozenset(
    {
        aten.clone.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.empty_like.default,
        aten._to_copy.default,
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
class _Chain:
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


@dataclass(frozen=True)
class FlattenUpdate(Pass):
    name = "flatten-update"
    summary = "one update per bucket: parameters and optimizer state as views of flat buffers"
    lay_out_gradients: bool = option(
        True,
        help="lay out the gradients that no bucket holds flat (one reduced at a time, or not reduced) in a "
        "persistent buffer per dtype, produced or copied into it, so their update is flat too",
    )

    def run(self, program: StepProgram) -> bool:
        changed = self.lay_out_gradients and _lay_out(program)
        bases = [n for n in program.graph.nodes if isinstance(n.meta.get(FLAT_GRADS), FlatGrads)]
        grads = {name: view for base in bases for name, view in _grad_views(base, base.meta[FLAT_GRADS]).items()}
        reach = _reach(program, grads)
        for base in bases:
            changed |= _flatten_bucket(program, base, reach)
        if changed:
            program.graph.eliminate_dead_code()
            repair_order(program.graph)
        return changed


def _flatten_bucket(program: StepProgram, base: fx.Node, reach: dict[fx.Node, str]) -> bool:
    """Flatten one bucket's parameters and update, or leave it as it is and say why in ``decisions``."""
    info: FlatGrads = base.meta[FLAT_GRADS]
    chains = _chains(program, base, info, reach)
    if isinstance(chains, str):
        program.decisions.setdefault("flatten-update", "")
        program.decisions["flatten-update"] += f"{info.tag}: per parameter ({chains}). "
        return False
    params = [c.placeholder for c in chains]
    value = params[0].meta["val"]
    flat_param = _flat_input(program, f"{info.tag}.param", value, info.length)
    program.flat_buffers.append(
        FlatBuffer(
            f"{info.tag}.param",
            "param",
            "",
            info.names,
            info.starts,
            tuple(tuple(p.meta["val"].shape) for p in params),
            tuple((0, n) for n in info.sizes),
            info.length,
            str(value.dtype).removeprefix("torch."),
            str(value.device),
        )
    )
    for r, run in enumerate(_runs(chains)):
        _vectorise(program, base, flat_param, info, r, run)
    repair_order(program.graph)  # what read a parameter's summary (a flag over all of them) follows the run's
    _drop_outputs(program, {c.name for c in chains})
    _forward_reads_views(program, flat_param, params, info.starts)
    _drop_inputs(program, {c.name for c in chains})
    return True


def _lay_out(program: StepProgram) -> bool:
    """The gradients the optimizer reads that no bucket holds flat, where every one of their updates could run
    flat, go into a persistent buffer per dtype and device (``bucket_views.write_into_buffer``: produced into it
    where their op has an ``out=`` form, else copied, one copy each), which then holds them as a bucket does."""
    held = {
        name
        for n in program.graph.nodes
        if isinstance(n.meta.get(FLAT_GRADS), FlatGrads)
        for name in n.meta[FLAT_GRADS].names
    }
    read = {name: node for name, node in optimizer_gradients(program).items() if name not in held}
    outputs = dict(zip(program.outputs, output_values(program)))
    reach = _reach(program, read)
    groups: dict[tuple[str, str], list[str]] = {}
    for name, grad in read.items():
        value = grad.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or aliased_to_output(grad):
            continue
        chain = _chain(program, name, grad, (0, value.numel()), 0)
        if isinstance(chain, str) or _trace_chain(chain, outputs, reach):
            return False  # one update that stays per parameter: laying the gradients out would only copy them
        groups.setdefault(_dtype_device(grad), []).append(name)
    order = position(program.graph)
    for index, names in enumerate(groups.values()):
        names = [names[i] for i in in_group_order(program, names)]
        nodes = [read[name] for name in names]
        cursor = Cursor(program.graph, max(nodes, key=order.__getitem__))
        ready, starts = write_into_buffer(program, nodes, "update", index, cursor)
        at = Cursor(program.graph, ready)
        for node, start in zip(nodes, starts):
            val = node.meta["val"]
            view = at.emit(
                aten.as_strided.default, (ready, list(val.shape), list(val.stride()), start), role="optimizer"
            )
            retarget_optimizer_input(node, view)
        sizes = tuple(n.meta["val"].numel() for n in nodes)
        ready.meta[FLAT_GRADS] = FlatGrads(
            f"update{index}", tuple(names), tuple(starts), sizes, ready.meta["val"].numel()
        )
        repair_order(program.graph)  # the updates that read the views come after the buffer
        order = position(program.graph)
    return bool(groups)


# ------------------------------------------------------------------ finding the chains


def _reach(program: StepProgram, grads: dict[str, fx.Node]) -> dict[fx.Node, str]:
    """Which parameter's update each node belongs to: the parameter whose own inputs, state or gradient (the
    node the update reads, ``grads``) it is computed from, or :data:`MANY` if from several (a global norm, the
    loss scale's overflow flag), or absent if from none. A value from several is shared: it does not make a node
    of one parameter's update belong to several."""
    sources: dict[fx.Node, str] = {}
    for port in program.inputs:
        if port.kind in ("param", "state"):
            sources[input_node(program, port)] = port.name.rsplit(".", 1)[0] if port.kind == "state" else port.name
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


def _chains(program: StepProgram, base: fx.Node, info: FlatGrads, reach: dict[fx.Node, str]) -> list[_Chain] | str:
    """Each parameter's update chain, or why the bucket cannot be flattened."""
    numel = base.meta["val"].numel()
    grads = _grad_views(base, info)
    outputs = dict(zip(program.outputs, output_values(program)))
    chains = []
    for i, (name, size) in enumerate(zip(info.names, info.sizes)):
        if name not in grads:
            return f"the optimizer does not read '{name}''s gradient as a view of the bucket"
        lo, hi = info.held(i, numel)
        chain = _chain(program, name, grads[name], (lo, hi), min(max(info.starts[i] + lo - info.offset, 0), numel))
        if isinstance(chain, str):
            return chain
        if chain.placeholder.meta["val"].numel() != size or _dtype_device(chain.placeholder) != _dtype_device(base):
            return f"'{name}' is not the size, dtype or device of its slot"
        why = _trace_chain(chain, outputs, reach)
        if why:
            return why
        chains.append(chain)
    return chains


def _chain(program: StepProgram, name: str, grad: fx.Node, held: tuple[int, int], at: int) -> _Chain | str:
    """Parameter ``name``'s update, whose gradient the optimizer reads at ``grad``, or why it has none to flatten."""
    ports = {p.name: p for p in program.inputs if p.kind in ("param", "state")}
    if Port("param", name) not in ports.values():
        return f"'{name}' is not a parameter input of the program"
    placeholder = input_node(program, Port("param", name))
    if placeholder.meta["val"].dim() == 0:
        return f"'{name}' is 0-d"
    param = _shard_read(placeholder, name) or placeholder  # a sharded update reads its slice
    if param.meta["val"].numel() != held[1] - held[0]:
        return f"the update of '{name}' does not read its elements {list(held)}"
    keys = [p.name.rsplit(".", 1)[1] for p in ports.values() if p.kind == "state" and p.name.startswith(name + ".")]
    states = {key: input_node(program, ports[f"{name}.{key}"]) for key in keys}
    return _Chain(name, placeholder, param, grad, states, held, at)


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


def _dtype_device(node: fx.Node) -> tuple[str, str]:
    val = node.meta["val"]
    return str(val.dtype).removeprefix("torch."), str(val.device)


def _grad_views(base: fx.Node, info: FlatGrads) -> dict[str, fx.Node]:
    """Per parameter, the node that views its gradient's slot of ``base``: the one its pass tagged
    (``meta["grad_slot"]``, empty slices of a shard too), else the view of its slot that the update reads."""
    numel = base.meta["val"].numel()
    slot = {}
    for i, (name, start) in enumerate(zip(info.names, info.starts)):
        lo, hi = info.held(i, numel)
        if hi > lo:
            slot[(start + lo - info.offset, start + hi - info.offset)] = name
    found: dict[str, fx.Node] = {}
    for node, span in contiguous_views(base).items():
        if node.meta.get("grad_slot") in info.names:
            found[node.meta["grad_slot"]] = node
            continue
        name = slot.get(span)
        if name is not None and any(u.meta.get("role") == "optimizer" for u in node.users):
            found.setdefault(name, node)  # the view the update reads (unflatten's last, after split and getitem)
    return found


def _trace_chain(chain: _Chain, outputs: dict[Port, fx.Node], reach: dict[fx.Node, str]) -> str:
    """Fill ``chain.nodes`` (the optimizer nodes computed from its sources and from no other parameter's) and
    ``chain.outputs``; check they are element-wise. Returns why not, or ''."""
    sources = {chain.param: ("param",), chain.grad: ("grad",), **{s: ("state", k) for k, s in chain.states.items()}}
    member: set[fx.Node] = set()
    frontier = [u for s in sources for u in s.users]
    while frontier:
        node = frontier.pop()
        if node in member or node.op != "call_function" or node.meta.get("role") != "optimizer":
            continue
        if any(reach.get(i, chain.name) not in (chain.name, MANY) for i in node.all_input_nodes):
            continue  # it also reads another parameter's update: a global value (a norm, a flag), not this chain
        member.add(node)
        frontier.extend(node.users)
    keys = _Keys(sources, reach)
    chain.nodes = keys.canonical(member, position(chain.param.graph))
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


def _kind(node: fx.Node, shape: torch.Size) -> str:
    """``tensor`` (shaped as the parameter), ``lane`` (0-d), ``scalar`` (a Python number) or ``other``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor" if val.shape == shape else "lane" if val.dim() == 0 else "other"
    return "scalar" if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)) else "other"


def _elementwise(chain: _Chain, sources: dict[fx.Node, tuple]) -> str:
    """'' if every op of the chain is element-wise in the parameter's elements; else why not."""
    shape = chain.param.meta["val"].shape
    for key, state in chain.states.items():
        if _kind(state, shape) not in ("tensor", "lane"):
            return f"state '{key}' of '{chain.name}' is neither shaped as the parameter nor 0-d"
    own = set(chain.nodes) | set(sources)
    for node in chain.nodes:
        kind = _kind(node, shape)
        inputs = [_kind(i, shape) for i in node.all_input_nodes]
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


class _Keys:
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

    def signature(self, chain: _Chain) -> tuple:
        body = tuple(self.node(n) for n in chain.nodes)
        writes = tuple(sorted((k, self.key(v)) for k, v in chain.outputs.items()))
        kinds = tuple(sorted((k, s.meta["val"].dim() == 0) for k, s in chain.states.items()))
        return body, writes, tuple(chain.summaries), kinds, str(chain.param.meta["val"].dtype)


def _runs(chains: list[_Chain]) -> list[list[_Chain]]:
    """Consecutive parameters (in slot order) whose updates are the same chain."""
    runs: list[list[_Chain]] = []
    for chain in chains:
        if runs and runs[-1][-1].signature == chain.signature:
            runs[-1].append(chain)
        else:
            runs.append([chain])
    return runs


# ------------------------------------------------------------------ rewriting


def _flat_input(program: StepProgram, port: str, like: torch.Tensor, length: int) -> fx.Node:
    with like.fake_mode:
        fake = torch.empty(length, dtype=like.dtype, device=like.device)
    return add_input(program, Port("flat", port), fake)


def _forward_reads_views(program: StepProgram, flat: fx.Node, params: list[fx.Node], starts: tuple[int, ...]) -> None:
    """Every reader of a parameter's own input reads its view of the flat parameters instead."""
    at = Cursor(program.graph, flat)
    for param, start in zip(params, starts):
        val = param.meta["val"]
        view = at.emit(aten.as_strided.default, (flat, list(val.shape), list(val.stride()), start), role="forward")
        param.replace_all_uses_with(view)


def _vectorise(program: StepProgram, base: fx.Node, flat_param: fx.Node, info: FlatGrads, r: int, run: list) -> None:
    """Run ``run``'s chain once on flat ranges: the parameters' and the gradients' range (in the bucket, or in
    this rank's shard of it), a flat input per state entry (a lane buffer for a 0-d one), and write the results
    back. A sharded run may hold no element here: its lanes (step counts) are still updated."""
    first = run[0]
    held = [c for c in run if c.held[1] > c.held[0]]
    lo = held[0].at if held else 0
    hi = held[-1].at + held[-1].held[1] - held[-1].held[0] if held else 0
    starts = tuple(min(max(c.at - lo, 0), hi - lo) for c in run)
    where = max((n for c in run for n in c.nodes), key=position(program.graph).__getitem__)
    cursor = Cursor(program.graph, where)
    env: dict[fx.Node, fx.Node] = {
        first.param: cursor.emit(
            aten.slice.Tensor, (flat_param, 0, info.offset + lo, info.offset + hi), role="optimizer"
        ),
        first.grad: cursor.emit(aten.slice.Tensor, (base, 0, lo, hi), role="optimizer"),
    }
    lanes: set[fx.Node] = set()  # the run's 0-d per-parameter values (a lane buffer each, once flat)
    lane0: dict[fx.Node, fx.Node] = {}  # a lane node -> its flat value's first element
    tag = f"{info.tag}.r{r}"
    for key, state in first.states.items():
        lane = state.meta["val"].dim() == 0
        like = state.meta["val"]
        size = len(run) if lane else hi - lo
        env[state] = _flat_input(program, f"{tag}.{key}", like, size)
        program.flat_buffers.append(
            FlatBuffer(
                f"{tag}.{key}",
                "state",
                key,
                tuple(c.name for c in run),
                tuple(range(len(run))) if lane else starts,
                tuple(() if lane else tuple(c.param.meta["val"].shape) for c in run),
                tuple(c.held for c in run),
                size,
                str(like.dtype).removeprefix("torch."),
                str(like.device),
            )
        )
        if lane:
            lanes.add(state)
    shape = first.param.meta["val"].shape
    for node in first.nodes:
        kind = _kind(node, shape)

        def read(arg: fx.Node, kind: str = kind) -> fx.Node:
            if arg in lanes and kind != "lane":  # a count read by the element-wise part: lane 0 stands for all
                if arg not in lane0:
                    lane0[arg] = cursor.emit(aten.select.int, (env[arg], 0, 0), role="optimizer")
                return lane0[arg]
            return env.get(arg, arg)

        args, kwargs = fx.node.map_arg(node.args, read), fx.node.map_arg(node.kwargs, read)
        if kind == "scalar":  # a Python number: its symbolic value stays what tracing made it
            with program.graph.inserting_after(cursor.anchor):
                copy = cursor.anchor = program.graph.call_function(node.target, args, kwargs)
            copy.meta["val"] = node.meta["val"]
        else:
            copy = cursor.emit(node.target, args, kwargs)
        copy.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "grad_of", "reduced_grad_of")})
        env[node] = copy
        if kind == "lane":
            lanes.add(node)
    for i in first.summaries:  # what read each parameter's summary reads the run's
        for chain in run:
            chain.nodes[i].replace_all_uses_with(env[first.nodes[i]])
    for (kind, key), value in first.outputs.items():
        target = env[first.param] if kind == "param" else env[first.states[key]]
        new = env.get(value, value)
        if new is not target:
            cursor.emit(aten.copy_.default, (target, new), role="optimizer", writes_back=tag)


def _owner(port: Port) -> str:
    return port.name.rsplit(".", 1)[0] if port.kind == "state" else port.name


def _drop_outputs(program: StepProgram, names: set[str]) -> None:
    """The flattened parameters' own outputs go (their update writes the flat buffers); so do the per-parameter
    updates, no longer read."""
    values = output_values(program)
    flat = [p.kind in ("param", "state") and _owner(p) in names for p in program.outputs]
    kept = [(p, v) for p, v, gone in zip(program.outputs, values, flat) if not gone]
    program.outputs = [p for p, _ in kept]
    set_output_values(program, [v for _, v in kept])
    program.graph.eliminate_dead_code()


def _drop_inputs(program: StepProgram, names: set[str]) -> None:
    """The flattened parameters' own inputs go: the flat buffers carry them now."""
    for node in [n for n in program.graph.nodes if n.op == "placeholder"]:
        port = node.meta.get("port")
        if port is not None and port.kind in ("param", "state") and _owner(port) in names:
            if node.users:
                raise AssertionError(f"'{node.name}' is still read by {list(node.users)[:3]}")
            program.graph.erase_node(node)
            program.inputs.remove(port)
