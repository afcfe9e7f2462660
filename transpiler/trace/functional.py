"""The two traces every step graph and every outer update goes through, and the optimizers' twins inside them.

``make_fx`` on fake tensors records the function's aten ops (nothing runs for real); a second ``make_fx`` over
``torch.func.functionalize`` of that graph turns in-place ops (the optimizer's ``add_``, a model's own) into
out-of-place ones with a ``copy_`` epilogue into the inputs. An optimizer whose default path branches on a
value of its state (a step count) is traced again in its capturable, tensor form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .environment import tracing_environment
from .optimizers import DataDependentStep, OptimizerPlan


def trace_functional(fn: Callable, inputs: list, plan: OptimizerPlan, *, symbolic_scalars: bool) -> fx.GraphModule:
    """``fn`` on ``inputs`` as one functional graph, in the tracing environment (``environment.py``)."""

    def trace() -> fx.GraphModule:
        first = _make_fx(fn, inputs, symbolic_scalars=symbolic_scalars)
        # The first graph holds the backward as plain ops, so its inputs need not require grad here; with
        # leaves that do, functionalize's copy_ epilogue fails on in-place ops (Embedding's max_norm renorm).
        plain = [t.detach() for t in inputs]
        return _without_aliases(
            _make_fx(functionalize(first, remove="mutations"), plain, symbolic_scalars=symbolic_scalars)
        )

    with tracing_environment():
        try:
            return trace()
        except DataDependentStep:
            if not plan.can_take_tensor_path():
                raise
            plan.tensor_path = True  # branches on the step count: its capturable (tensor) form instead
            return trace()


def _make_fx(fn: Callable, inputs: list, *, symbolic_scalars: bool) -> fx.GraphModule:
    """``make_fx`` on fake tensors. With ``symbolic_scalars`` the fake tensors carry a shape environment (shapes
    stay static): ``.item()`` gives a symbolic float and Python arithmetic on it becomes graph nodes (the
    generic optimizer path: step counts, bias corrections, lr). No pass reads which torch function made a node
    (``meta["torch_fn"]``), so make_fx does not record it: a trace takes 4% (GPT-2) to 18% (a small model) less
    CPU time."""
    if not symbolic_scalars:
        return make_fx(fn, tracing_mode="fake", _disable_torch_fn_metadata_mode=True)(*inputs)
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    fakes = [mode.from_tensor(t) for t in inputs]
    with mode:
        return make_fx(fn, tracing_mode="real", _disable_torch_fn_metadata_mode=True)(*fakes)


def _without_aliases(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` with each ``aten.alias`` node replaced by its input. torch 2.14 records autograd's detaches
    (a saved output in a backward formula, an optimizer's ``p.detach()``, the returned loss) as ``alias`` nodes
    where 2.11 and 2.13 record nothing; in a functional graph an alias is its input, and the passes, which find
    the loss's gradient seed among the loss's users, read the graph the earlier releases give."""
    aliases = [n for n in module.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.alias.default]
    for node in aliases:
        node.replace_all_uses_with(node.args[0])
        module.graph.erase_node(node)
    if aliases:  # a recompile costs a trace some milliseconds: only where the graph changed
        module.recompile()
    return module


def twin_updates(
    plan: OptimizerPlan, params: list, grads: list, states: list, scalars: dict[str, torch.Tensor]
) -> tuple[list, list]:
    """Each parameter through its functional twin; an unused parameter (no gradient) is left as it is."""
    new_params, new_states = [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:  # unused parameter: eager skips it too
            new_params.append(p.detach())
            new_states.append(states[i])
            continue
        new_p, new_s = plan.update(i, p.detach(), g, states[i], scalars)
        new_params.append(new_p)
        new_states.append(new_s)
    return new_params, new_states
