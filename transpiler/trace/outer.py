"""Trace an outer optimizer's update on its own (DiLoCo's outer step), for a pass to inline.

DiLoCo keeps global weights θ and an outer optimizer over them whose gradient is the averaged
pseudo-gradient Δ. That update is any ``torch.optim`` optimizer's, traced as the step's own update is:
SGD, Adam and AdamW through their functional twins, any other through its own ``step()`` (the generic
path). The result is a small graph, ``(θ, Δ, state, scalars) -> (θ', state')``, that the pass
``diloco-outer-step`` inlines after the all-reduce of Δ; the outer optimizer's state stays in that
optimizer (``outer.state``) and its lr is read from its param groups every sync, so schedulers work.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.errors import UnsupportedModelError, UnsupportedOptimizerError
from transpiler.graph.ports import Port
from transpiler.graph.program import OuterUpdate

from .functional import trace_functional, twin_updates
from .optimizers import GenericPlan, OptimizerPlan, make_plan
from .step_inputs import ModelState
from .tracer import _scalar_inputs_as_floats


def trace_outer_update(outer: torch.optim.Optimizer, state: ModelState) -> tuple[OuterUpdate, OptimizerPlan]:
    """The outer optimizer's update over the model's trainable parameters, and the plan that feeds it."""
    plan = make_plan(outer, state.params, state.names)
    generic = isinstance(plan, GenericPlan)
    n = len(state.params)
    states = [plan.state_tensors(i) for i in range(n)]
    counts = [len(s) for s in states]
    slots = [slot.name for slot in plan.scalar_slots()]
    device = state.params[0].device if plan.scalars_as_tensors else torch.device("cpu")

    def update(*flat: torch.Tensor):
        thetas, grads, rest = list(flat[:n]), list(flat[n : 2 * n]), flat[2 * n :]
        grouped, pos = [], 0
        for c in counts:
            grouped.append(list(rest[pos : pos + c]))
            pos += c
        scalars = list(rest[pos:])
        if generic:
            new, updated = plan.step_all(thetas, grads, grouped, scalars)
        else:
            new, updated = twin_updates(plan, thetas, grads, grouped, dict(zip(slots, scalars)))
        return (*new, *[t for s in updated for t in s])

    inputs = [
        *[p.detach() for p in state.params],
        *[torch.zeros_like(p.detach()) for p in state.params],
        *[t for s in states for t in s],
        *[torch.tensor(v, dtype=torch.float64, device=device) for v in plan.scalar_values()],
    ]

    try:
        gm = trace_functional(update, inputs, plan, symbolic_scalars=generic)
    except (UnsupportedModelError, UnsupportedOptimizerError):
        raise
    except Exception as exc:
        raise UnsupportedOptimizerError(
            f"tracing the outer optimizer {type(outer).__name__} failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else ''}"
        ) from exc
    in_ports = (
        [Port("param", name) for name in state.names]
        + [Port("grad", name) for name in state.names]
        + [Port("state", f"{state.names[i]}.{k}") for i in range(n) for k in plan.state_keys(i)]
        + [Port("scalar", name) for name in slots]
    )
    out_ports = [Port("param", name) for name in state.names] + [
        Port("state", f"{state.names[i]}.{k}") for i in range(n) for k in plan.output_state_keys(i)
    ]
    _name_inputs(gm, in_ports, generic)
    return OuterUpdate(gm, tuple(in_ports), tuple(out_ports)), plan


def _name_inputs(gm: fx.GraphModule, ports: list[Port], generic: bool) -> None:
    """Tag each placeholder with its port; drop functionalisation's copies into inputs and no-op detaches."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, port in zip(placeholders, ports):
        node.meta["port"] = port
    for node in list(graph.nodes):
        copy_into_input = node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder"
        if node.op == "call_function" and (copy_into_input or node.target is torch.ops.aten.detach.default):
            node.replace_all_uses_with(node.args[1] if copy_into_input else node.args[0])
            graph.erase_node(node)
    output = graph.output_node()
    output.args = (tuple(torch.utils._pytree.tree_leaves(output.args[0])),)
    if generic:  # the runtime feeds the generic path's lrs as floats
        _scalar_inputs_as_floats(graph)
    graph.eliminate_dead_code()
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["role"] = "optimizer"
            node.meta["outer"] = True
    graph.lint()
    gm.recompile()
