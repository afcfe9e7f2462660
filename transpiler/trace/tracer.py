"""Trace one whole training step into one functional, aten-level fx graph.

The step is ``forward -> loss -> autograd.grad -> optimizer update``. It is
traced with fake tensors (nothing runs for real), then re-traced through
``torch.func.functionalize`` so in-place ops become out-of-place ones. Each
node is tagged with its role (``node.meta["role"]``) and each gradient with
the parameter it belongs to (``node.meta["grad_of"]``). The graph's inputs and
outputs are listed as :class:`~transpiler.program.Port` s.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from transpiler.errors import TraceMismatchError, UnsupportedModelError, UnsupportedOptimizerError
from transpiler.graph.collectives import is_collective
from transpiler.graph.ports import Port, PortKind, is_input
from transpiler.graph.program import StepProgram

from .batch_fit import Phase, check_matmul_dtypes, explain, quiet_fake_tensor_failures
from .environment import AUTOCAST_OFF, AutocastState
from .functional import trace_functional, twin_updates
from .optimizers import GenericPlan, OptimizerPlan
from .signature import StepSignature, StepTrace, step_signature
from .step_inputs import LossFn, ModelState, step_inputs
from .tensor_parallel import as_local, check_update, tensor_parallel_of


def trace_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: tuple,
    autocast: AutocastState = AUTOCAST_OFF,
    shards: Mapping[str, tuple[int, int]] | None = None,
    whole_shapes: Mapping[str, tuple[int, ...]] | None = None,
    reuse: StepTrace | Mapping[StepSignature, StepTrace] | None = None,
) -> tuple[StepTrace, ModelState, OptimizerPlan]:
    """Trace forward, loss, backward and optimizer update of one step into a StepProgram; the forward and the
    loss under ``autocast`` (the caller's), the backward and the update without it, as eager autocast runs.
    ``shards`` (parameter name -> flat ``[lo, hi)``, empty before a sharded mode's first program) is given
    under a mode that holds the optimizer state as 1-D slices: the update is traced whole, on stand-ins
    shaped as the parameter, and the mode cuts it again. ``whole_shapes`` (ZeRO-3) gives the whole shape of
    each parameter the model holds as a 1-D slice between steps: it is traced on an uninitialised stand-in of
    that shape. ``reuse``: a trace of a step with the same signature (``signature.py``), copied instead of
    tracing again (a :class:`TraceMismatchError` names the first difference); or traces by signature, of which
    the one with this step's signature, if any, is copied. The trace returned is the caller's to change."""
    inputs = step_inputs(model, optimizer, loss_fn, batch, shards, whole_shapes)
    state, plan, wholes, opt_states = inputs.state, inputs.plan, inputs.params, inputs.opt_states
    generic = isinstance(plan, GenericPlan)
    counts = [len(s) for s in opt_states]
    n_p, n_f, n_b = len(state.params), len(state.frozen), len(state.buffers)
    n_model_out: list[int] = []
    grad_present: list[bool] = []
    slots = [slot.name for slot in plan.scalar_slots()]
    signature = step_signature(model, plan, loss_fn, wholes, opt_states, batch, autocast)
    known = reuse if isinstance(reuse, StepTrace) or reuse is None else reuse.get(signature)
    if known is not None:
        difference = signature.first_difference(known.signature)
        if difference is not None:
            raise TraceMismatchError(
                f"the trace given to transpile(trace=...) was made for another step: {difference}. Trace this "
                "model, optimizer and batch with transpiler.trace_training_step(), or leave trace= out."
            )
        plan.adopt(known.learnt)
        return StepTrace(known.program.clone(), signature, known.learnt), state, plan
    # the twins' slots live where the parameters are (a captured program reads them there); the generic
    # path's lrs become floats after tracing
    scalar_device = state.params[0].device if plan.scalars_as_tensors and state.params else torch.device("cpu")
    phase = Phase()  # which part of the step a failure came from

    def step_fn(*flat: torch.Tensor):
        params, rest = list(flat[:n_p]), flat[n_p:]
        frozen, buffers, rest = rest[:n_f], rest[n_f : n_f + n_b], rest[n_f + n_b :]
        states, pos = [], 0
        for c in counts:
            states.append(list(rest[pos : pos + c]))
            pos += c
        data, scalars = rest[pos : len(rest) - len(slots)], rest[len(rest) - len(slots) :]
        tensors = dict(zip(state.names, params))
        tensors.update(zip(state.frozen_names, frozen))
        tensors.update(zip(state.buffer_names, buffers))
        inputs = tuple(data[:-1]) if loss_fn is not None else tuple(data)
        # The backward runs inside the re-parametrisation too: activation checkpointing recomputes the forward
        # there and must see the traced parameters, not the module's real ones.
        with _reparametrize_module(model, tensors, tie_weights=True, strict=False):
            with autocast.applied():
                phase.current = "forward"
                out = model(*inputs)
                phase.current = "loss"
                loss = loss_fn(out, data[-1]) if loss_fn is not None else out
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                raise UnsupportedModelError(
                    "the loss must be a floating-point tensor with one element; "
                    f"got {type(loss).__name__} {getattr(loss, 'shape', '')}. Reduce it (mean or sum) in loss_fn."
                )
            seed = torch.ones_like(loss)
            phase.current = "backward"
            grads = _distinct(torch.autograd.grad(loss, params, seed, allow_unused=True))
        grad_present[:] = [g is not None for g in grads]
        phase.current = "update"
        if generic:
            new_params, updated = plan.step_all(params, grads, states, list(scalars))
        else:
            new_params, updated = twin_updates(plan, params, grads, states, dict(zip(slots, scalars)))
        new_states = [t for s in updated for t in s]
        out_leaves = [as_local(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)] if loss_fn else []
        n_model_out[:] = [len(out_leaves)]
        return (
            as_local(loss.detach()),
            *out_leaves,
            *[g for g in grads if g is not None],
            *new_params,
            *new_states,
            *buffers,
        )

    flat_inputs = [
        *[p.detach().requires_grad_(True) for p in wholes],
        *[p.detach() for p in state.frozen],
        *state.buffers,
        *[t for s in opt_states for t in s],
        *batch,
        *[torch.tensor(v, dtype=torch.float64, device=scalar_device) for v in plan.scalar_values()],
    ]
    snapshot = [t.clone() for t in state.buffers]  # tracing must not touch real buffers

    try:
        with quiet_fake_tensor_failures():
            functional = trace_functional(step_fn, flat_inputs, plan, symbolic_scalars=generic)
        check_matmul_dtypes(functional.graph)
    except (UnsupportedModelError, UnsupportedOptimizerError):
        raise
    except Exception as exc:  # torch raises many kinds while tracing; name the cause plainly
        probed = dict(zip(state.names, [w.detach() for w in wholes]))
        probed.update(zip(state.frozen_names, state.frozen))
        probed.update(zip(state.buffer_names, [b.clone() for b in snapshot]))
        raise explain(exc, phase.current, model, loss_fn, batch, probed, autocast)  # noqa: B904 - its cause is set
    finally:
        with torch.no_grad():
            for b, s in zip(state.buffers, snapshot):
                b.copy_(s)
    ports = (
        [Port("param", n) for n in state.names]
        + [Port("frozen", n) for n in state.frozen_names]
        + [Port("buffer", n) for n in state.buffer_names]
        + [Port("state", f"{state.names[i]}.{k}") for i in range(n_p) for k in plan.state_keys(i)]
        + [Port("batch", f"batch{i}") for i in range(len(batch))]
        + [Port("scalar", name) for name in slots]
    )
    used = [n for n, ok in zip(state.names, grad_present) if ok]
    program = _finish(functional, ports, plan, n_model_out[0], used)
    tensor_parallel = tensor_parallel_of(model)
    if tensor_parallel is not None:
        check_update(program.graph)
        for node in program.graph.nodes:  # every collective of the trace is the plan's, on the 'tp' group
            if is_collective(node):
                node.meta["mesh_dim"] = "tp"
        program.decisions["tensor-parallel"] = (
            f"traced through DTensor: {len(tensor_parallel.specs)} parameters are DTensors on 'tp' "
            f"({tensor_parallel.size} ranks); this rank's program holds its shards"
        )
    if generic:
        how = (
            "its capturable (tensor) form, since its default path branches on a value of its state"
            if plan.tensor_path
            else "its default path, Python scalars traced symbolically"
        )
        program.decisions["optimizer"] = f"{type(optimizer).__name__}.step() traced in {how}"
    return StepTrace(program, signature, plan.learnt()), state, plan


def _distinct(grads: tuple) -> list:
    """One tensor per parameter's gradient. Autograd hands the same tensor to parameters whose gradients are
    equal (an LSTM's ``bias_ih`` and ``bias_hh``); a copy for each repeat gives every parameter its own
    gradient node, so passes that treat gradients one by one (``grad_of``) see all of them."""
    seen: set[int] = set()
    out = []
    for g in grads:
        if g is not None and id(g) in seen:
            g = g.clone()
        elif g is not None:
            seen.add(id(g))
        out.append(g)
    return out


def _finish(
    gm: fx.GraphModule, in_ports: list[Port], plan: OptimizerPlan, n_out: int, grads_of: list[str]
) -> StepProgram:
    """Clean the functional trace, name its inputs, tag roles."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()  # plain positional signature instead of pytree
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = graph.output_node()
    slot = {ph: i for i, ph in enumerate(placeholders)}
    mutated_frozen: list[tuple[Port, fx.Node]] = []
    for node in list(graph.nodes):  # functionalize's copy_ epilogue: we return new values instead
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten.copy_.default
            and node.args[0].op == "placeholder"
        ):
            port = in_ports[slot[node.args[0]]]
            if port.kind == "batch":
                raise UnsupportedModelError(
                    f"the model modifies its input {port.name} in place; clone it inside forward first."
                )
            if port.kind == "frozen":  # e.g. Embedding(max_norm=...) renormalising a frozen table
                mutated_frozen.append((port, node.args[1]))
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
    for node in list(graph.nodes):  # detach is a no-op without autograd
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    results = list(pytree.tree_leaves(output.args[0]))

    renamed: list[fx.Node] = []
    with graph.inserting_before(placeholders[0]):
        for port in in_ports:
            renamed.append(graph.placeholder(_ident(port)))
    for old, new, port in zip(placeholders, renamed, in_ports):
        new.meta.update(old.meta)
        new.meta["port"] = port
        old.replace_all_uses_with(new)
        graph.erase_node(old)
    results = [renamed[slot[r]] if r in slot else r for r in results]
    if not plan.scalars_as_tensors:
        _scalar_inputs_as_floats(graph)

    loss, model_out = results[0], results[1 : 1 + n_out]
    grads = results[1 + n_out : 1 + n_out + len(grads_of)]
    rest = results[1 + n_out + len(grads_of) :]
    for name, g in zip(grads_of, grads):
        g.meta["grad_of"] = name
    names = [p.name for p in in_ports if p.kind == "param"]
    out_ports = [Port("loss", "loss")] + [p for p in in_ports if p.kind == "param"]
    out_ports += [Port("state", f"{names[i]}.{k}") for i in range(len(names)) for k in plan.output_state_keys(i)]
    out_ports += [p for p in in_ports if p.kind == "buffer"]
    out_ports += [port for port, _ in mutated_frozen]
    rest += [value for _, value in mutated_frozen]
    output.args = (tuple([loss, *rest]),)
    graph.eliminate_dead_code()
    _tag_roles(graph, loss, model_out, grads)
    graph.lint()
    gm.recompile()
    program = StepProgram(gm, in_ports, out_ports)
    program.param_groups = {name: plan.group_of[i].index for i, name in enumerate(names)}  # in model order
    program.snapshot("traced", gm.code)
    return program


def _ident(port: Port) -> str:
    prefix = {"param": "p", "frozen": "frozen", "buffer": "buf", "state": "opt", "batch": "", "scalar": "s"}[port.kind]
    name = "".join(c if c.isalnum() else "_" for c in port.name)
    return f"{prefix}_{name}" if prefix else name


def _scalar_inputs_as_floats(graph: fx.Graph) -> None:
    """The generic path traced each lr as a 0-d float64 tensor; the runtime feeds the float itself. A read
    of it with ``.item()`` goes; a reader of the tensor (a capturable form) gets one made from the float.
    Profiler markers of ``Optimizer.step`` go too: they would only cost time."""
    local_scalar = torch.ops.aten._local_scalar_dense.default
    for node in list(graph.nodes):
        if not is_input(node, PortKind.SCALAR) or "val" not in node.meta:
            continue
        tensor_readers = [u for u in node.users if u.target is not local_scalar]
        if tensor_readers:
            with graph.inserting_after(node):
                tensor = graph.call_function(torch.ops.aten.scalar_tensor.default, (node,), {"dtype": torch.float64})
            tensor.meta.update(val=node.meta["val"], role="optimizer")
            for reader in tensor_readers:
                reader.replace_input_with(node, tensor)
        for reader in [u for u in node.users if u.target is local_scalar]:
            reader.replace_all_uses_with(node)
            graph.erase_node(reader)
        node.meta.pop("val")
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "profiler" and not node.users:
            graph.erase_node(node)


def _tag_roles(graph: fx.Graph, loss: fx.Node, model_out: list[fx.Node], grads: list[fx.Node]) -> None:
    """Tag by execution order, which make_fx records faithfully: forward, loss, seed, backward, optimizer."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    end_forward = max((order[n] for n in model_out if n.op != "placeholder"), default=-1)
    if not model_out:  # the model returns its own loss
        end_forward = order[loss]
    seed = next((u for u in loss.users if u.target is torch.ops.aten.ones_like.default), None)
    end_backward = max((order[g] for g in grads), default=order[loss])
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        i = order[node]
        if node is seed:
            role = "loss_grad"
        elif i <= end_forward:
            role = "forward"
        elif i <= order[loss]:
            role = "loss"
        elif i <= end_backward:
            role = "backward"
        else:
            role = "optimizer"
        node.meta["role"] = role
    for node in graph.nodes:  # getitem of a multi-output op shares its producer's role
        if node.target is operator.getitem and "role" in node.args[0].meta:
            node.meta["role"] = node.args[0].meta["role"]
