"""``foreach-update``: the updates that stay per parameter run as multi-tensor (``_foreach_*``) ops.

Requires: the per-parameter update the optimizer was traced into, after ``flatten-update`` (which takes what
can run on flat buffers; this pass sees only the parameters it left).
Guarantees: parameters whose updates are the same chain op for op (``update_chains``: one param group, one
dtype and device, the same constants and shared inputs) form a group, and each position of their chains
whose op has a ``_foreach_*`` twin becomes one op over the group's tensors, read back with ``getitem``; the
other positions (ops with no twin, values computed from several parameters, Python numbers) stay per
parameter. A value the chains share (a learning rate held as a 0-d tensor, a constant) is passed once where
the twin takes one, and repeated in a list where it takes a list. What stays per parameter and why, and the
groups, are in ``decisions``.

On the CPU a ``_foreach_*`` op applies the per-tensor kernel to each tensor in turn, so the bits are the
for-loop's, in every dtype (tested); on CUDA its fused kernels are those torch's foreach optimizers run (a 0-d
operand cast to the tensors' dtype, so that they take the fused path). Each op goes as late as its readers
allow, and is functional here; ``reinplace-optimizer`` then runs it in place where it would run the single ops
(every tensor of its list, or none), so only the temporaries eager's foreach update also makes are new.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from transpiler.graph.edit import Cursor, position, repair_order
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram

from .gradient_flow import optimizer_gradients
from .update_chains import MANY, Chain, Keys, chain_of, collect, reach_of

aten = torch.ops.aten
_NUMBER = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True)
class ForeachUpdate(Pass):
    name = "foreach-update"
    invalidates = frozenset({Fact.PER_PARAMETER})
    summary = "updates left per parameter: one _foreach_* op per position of the chain, per group of parameters"

    def run(self, program: StepProgram) -> bool:
        grads = {n: g for n, g in optimizer_gradients(program).items() if Port("param", n) in program.inputs}
        reach = reach_of(program, grads)
        groups: dict[tuple, list[Chain]] = {}
        for name, grad in grads.items():
            chain = chain_of(program, name, grad)
            if isinstance(chain, Chain):
                chain.signature = collect(chain, reach).signature(chain)
                groups.setdefault(chain.signature, []).append(chain)
        changed, said = False, []
        for chains in (g for g in groups.values() if len(g) > 1 and g[0].nodes):
            merged = sum(_merge(program, [c.nodes[k] for c in chains], reach) for k in range(len(chains[0].nodes)))
            said.append(f"{len(chains)} parameters ({chains[0].name}, ...): {merged} of {len(chains[0].nodes)} ops")
            changed |= merged > 0
        if changed:
            program.decisions["foreach-update"] = "; ".join(said) + " as one multi-tensor op each"
            repair_order(program.graph)  # a chain's per-parameter op after the multi-tensor op that now feeds it
            program.graph.eliminate_dead_code()
        return changed


def _merge(program: StepProgram, nodes: list[fx.Node], reach: dict[fx.Node, str]) -> bool:
    """Replace the same op of several chains by its ``_foreach_*`` twin over all of them; whether it could."""
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes):
        return False  # a Python number, or several results: kept per parameter
    if any(reach.get(i) == MANY for n in nodes for i in n.all_input_nodes):
        return False  # a value of several parameters' updates could come after this op of another's: no cycle
    call = _foreach_call(nodes, Keys({}, reach))
    if call is None:
        return False
    target, args, kwargs = call
    order = position(program.graph)
    last_input = max((i for n in nodes for i in n.all_input_nodes), key=order.__getitem__)
    before_first_reader = min((u for n in nodes for u in n.users), key=order.__getitem__).prev
    # as late as its readers allow, not right after its inputs: a weight decay reads only the parameters and would
    # run before the forward, its results held through the step (and never written in place, since the gathers
    # read the parameters after it)
    cursor = Cursor(program.graph, max(last_input, before_first_reader, key=order.__getitem__))
    args = _operand_in_the_tensors_dtype(cursor, args)
    # its results are the per-parameter ops' values: the twin computes each tensor as that op does
    joined = cursor.emit(target, args, kwargs, role="optimizer", val=[n.meta["val"] for n in nodes])
    for j, node in enumerate(nodes):
        item = cursor.emit(operator.getitem, (joined, j), role="optimizer", val=node.meta["val"])
        item.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "stack_trace")})
        node.replace_all_uses_with(item)
        program.graph.erase_node(node)
    return True


def _operand_in_the_tensors_dtype(cursor: Cursor, args: tuple) -> tuple:
    """``args`` with a 0-d tensor operand (the per-step scalars are float64) cast once to the tensors' dtype,
    float32 or float64 on a GPU. CUDA's multi-tensor kernels take such an operand only in the tensors' dtype;
    another sends the op down its per-tensor path, one kernel per tensor (447 a step for AdamW over the narrow
    GPT's 149 parameters, measured on an H200). Both paths read the operand in the tensors' dtype, where the
    arithmetic runs for these two dtypes, so the bits stay (``tests/test_gpu.py`` checks). On the CPU every
    ``_foreach_*`` op runs per tensor anyway: nothing to gain, and the program stays as it was."""
    first = args[0][0].meta["val"] if args and isinstance(args[0], list) and _is_tensor(args[0][0]) else None
    if first is None or first.device.type == "cpu" or first.dtype not in (torch.float32, torch.float64):
        return args
    out = list(args)
    for i, value in enumerate(args[1:], start=1):
        if _is_tensor(value) and value.meta["val"].dim() == 0 and value.meta["val"].dtype != first.dtype:
            out[i] = cursor.emit(aten._to_copy.default, (value,), {"dtype": first.dtype}, role="optimizer")
    return tuple(out)


def _foreach_call(nodes: list[fx.Node], keys: Keys) -> tuple[torch._ops.OpOverload, tuple, dict] | None:
    """The ``_foreach_*`` overload and arguments that compute every node at once, or None."""
    target = nodes[0].target
    if not isinstance(target, torch._ops.OpOverload) or target.is_view:
        return None
    packet = getattr(aten, "_foreach_" + target._schema.name.split("::")[-1], None)
    if packet is None or target._schema.is_mutable:
        return None
    columns = _columns(target, nodes, keys)
    if columns is None:
        return None
    best = None
    for overload in packet.overloads():
        twin = getattr(packet, overload)
        fitted = _fit(twin._schema, target._schema, columns, len(nodes))
        if fitted is not None and (best is None or fitted[0] < best[0]):
            best = (fitted[0], twin, *fitted[1:])
    return None if best is None else best[1:]


def _columns(target: torch._ops.OpOverload, nodes: list[fx.Node], keys: Keys) -> list[tuple[str, object]] | None:
    """Per argument of ``target``'s schema: ("same", value) when every node passes the same (the same constant,
    node, or computation from no parameter's values: the generic path traces ``-lr`` once per parameter),
    ("list", values) when they differ. None when a node's call cannot be read against the schema."""
    calls = []
    for node in nodes:  # every argument, defaults filled in, in the schema's order (``self`` named ``input``)
        pair = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if pair is None or len(pair.kwargs) != len(target._schema.arguments):
            return None
        calls.append(list(pair.kwargs.values()))
    columns = []
    for i in range(len(target._schema.arguments)):
        values = [call[i] for call in calls]
        same = all(v is values[0] or keys.key(v) == keys.key(values[0]) for v in values)
        columns.append(("same", values[0]) if same else ("list", values))
    return columns


def _is_tensor(value: object) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _is_number(value: object) -> bool:
    return isinstance(value, _NUMBER) or (isinstance(value, fx.Node) and isinstance(value.meta.get("val"), _NUMBER))


def _fit(twin: torch.FunctionSchema, schema: torch.FunctionSchema, columns: list, n: int) -> tuple | None:
    """How many shared values the twin repeats into lists, and its arguments and keyword arguments for
    ``columns`` (matched by position; an argument of the original past the twin's last must hold its default),
    or None where the twin does not take them."""
    params = [a for a in twin.arguments if not a.is_out]
    extra = zip(columns[len(params) :], schema.arguments[len(params) :])
    if twin.is_mutable or any(column != ("same", arg.default_value) for column, arg in extra):
        return None
    values, repeats = [], 0
    for i, param in enumerate(params):
        if i >= len(columns):
            if not param.has_default_value():
                return None
            break
        how, value = columns[i]
        kind = param.type
        if isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType):
            items = value if how == "list" else [value] * n
            if not all(_is_tensor(v) for v in items) or (i == 0 and how != "list"):
                return None
            repeats += how == "same"
            values.append(list(items))
        elif isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.NumberType):
            items = value if how == "list" else [value] * n
            if not all(_is_number(v) for v in items):
                return None
            repeats += how == "same"
            values.append(list(items))
        elif isinstance(kind, torch.TensorType):
            if how != "same" or not _is_tensor(value):
                return None
            values.append(value)
        elif isinstance(kind, torch.NumberType):
            if how != "same" or not _is_number(value):
                return None
            values.append(value)
        else:  # a flag or an option: the same for all
            if how != "same" or isinstance(value, fx.Node):
                return None
            values.append(value)
    positional = [v for v, p in zip(values, params) if not p.kwarg_only]
    return repeats, tuple(positional), {p.name: v for v, p in zip(values, params) if p.kwarg_only}
