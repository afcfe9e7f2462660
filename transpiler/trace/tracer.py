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
from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from transpiler.errors import TraceMismatchError, UnsupportedModelError, UnsupportedOptimizerError
from transpiler.graph.collectives import is_collective
from transpiler.graph.ports import Port, PortKind, is_input
from transpiler.graph.program import StepProgram

from .batch_fit import Phase, check_operand_dtypes, explain, quiet_fake_tensor_failures
from .environment import AUTOCAST_OFF, AutocastState
from .functional import trace_functional, twin_updates
from .optimizers import GenericPlan, OptimizerPlan
from .signature import StepSignature, StepTrace, step_signature
from .stage_marks import marked_stages
from .step_inputs import LossFn, ModelState, StepInputs, step_inputs
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
    split_points: Sequence[str] = (),
) -> tuple[StepTrace, ModelState, OptimizerPlan]:
    """Trace forward, loss, backward and optimizer update of one step into a StepProgram; the forward and the
    loss under ``autocast`` (the caller's), the backward and the update without it, as eager autocast runs.
    ``shards`` (parameter name -> flat ``[lo, hi)``, empty before a sharded mode's first program) is given
    under a mode that holds the optimizer state as 1-D slices: the update is traced whole, on stand-ins
    shaped as the parameter, and the mode cuts it again. ``whole_shapes`` (ZeRO-3) gives the whole shape of
    each parameter the model holds as a 1-D slice between steps: it is traced on an uninitialised stand-in of
    that shape. ``reuse``: a trace of a step with the same signature (``signature.py``), copied instead of
    tracing again (a :class:`TraceMismatchError` names the first difference); or traces by signature, of which
    the one with this step's signature, if any, is copied. The trace returned is the caller's to change.
    ``split_points``: a pipeline's, marked in the trace where each stage starts (``stage_marks.py``); such a trace
    is never reused."""
    inputs = step_inputs(model, optimizer, loss_fn, batch, shards, whole_shapes)
    state, plan = inputs.state, inputs.plan
    signature = step_signature(model, plan, loss_fn, inputs.params, inputs.opt_states, batch, autocast)
    if split_points:
        reuse = None
    known = reuse if isinstance(reuse, StepTrace) or reuse is None else reuse.get(signature)
    if known is not None:
        difference = signature.first_difference(known.signature)
        if difference is not None:
            raise TraceMismatchError(
                f"the trace given to transpile(trace=...) was made for another step: {difference}. Trace this "
                "model, optimizer and batch with transpiler.trace_training_step(), or leave trace= out."
            )
        plan.adopt(known.learnt)
        return StepTrace(known.program.sharing_graphs(), signature, known.learnt), state, plan
    step_fn = StepFunction(model, loss_fn, autocast, inputs)
    with marked_stages(model, split_points):
        functional = _traced(step_fn, inputs, batch)
    ports = (
        [Port("param", n) for n in state.names]
        + [Port("frozen", n) for n in state.frozen_names]
        + [Port("buffer", n) for n in state.buffer_names]
        + [Port("state", f"{state.names[i]}.{k}") for i in range(len(state.names)) for k in plan.state_keys(i)]
        + [Port("batch", f"batch{i}") for i in range(len(batch))]
        + [Port("scalar", slot) for slot in step_fn.slots]
    )
    used = [n for n, ok in zip(state.names, step_fn.grad_present) if ok]
    program = _finish(functional, ports, plan, step_fn.model_outputs, used)
    _tag_tensor_parallel(program, model)
    if step_fn.generic:
        how = (
            "its capturable (tensor) form, since its default path branches on a value of its state"
            if plan.tensor_path
            else "its default path, Python scalars traced symbolically"
        )
        program.decisions["optimizer"] = f"{type(optimizer).__name__}.step() traced in {how}"
    return StepTrace(program, signature, plan.learnt()), state, plan


class StepFunction:
    """The step as one function of flat tensors (``make_fx`` traces it): parameters, frozen parameters, buffers,
    optimizer state, the batch and the optimizer's scalars in, the loss, the model's outputs, the gradients, the new
    parameters, state and buffers out. A call records what only tracing tells: which parameters got a gradient, and
    how many tensors the model returned; ``phase`` says which part of the step was running when tracing failed."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, autocast: AutocastState, inputs: StepInputs) -> None:
        self.model, self.loss_fn, self.autocast = model, loss_fn, autocast
        self.state, self.plan = inputs.state, inputs.plan
        self.generic = isinstance(self.plan, GenericPlan)
        self.counts = [len(s) for s in inputs.opt_states]
        self.slots = [slot.name for slot in self.plan.scalar_slots()]
        self.phase = Phase()
        self.grad_present: list[bool] = []
        self.model_outputs = 0

    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state, n_p, n_f, n_b = self.state, len(self.state.params), len(self.state.frozen), len(self.state.buffers)
        params, rest = list(flat[:n_p]), flat[n_p:]
        frozen, buffers, rest = rest[:n_f], rest[n_f : n_f + n_b], rest[n_f + n_b :]
        states, pos = [], 0
        for c in self.counts:
            states.append(list(rest[pos : pos + c]))
            pos += c
        data, scalars = rest[pos : len(rest) - len(self.slots)], rest[len(rest) - len(self.slots) :]
        tensors = dict(zip(state.names, params))
        tensors.update(zip(state.frozen_names, frozen))
        tensors.update(zip(state.buffer_names, buffers))
        out, loss, grads = self._forward_backward(tensors, params, data)
        self.grad_present[:] = [g is not None for g in grads]
        self.phase.current = "update"
        if self.generic:
            new_params, updated = self.plan.step_all(params, grads, states, list(scalars))
        else:
            new_params, updated = twin_updates(self.plan, params, grads, states, dict(zip(self.slots, scalars)))
        new_states = [t for s in updated for t in s]
        leaves = pytree.tree_leaves(out) if self.loss_fn is not None else []
        out_leaves = [as_local(t) for t in leaves if isinstance(t, torch.Tensor)]
        self.model_outputs = len(out_leaves)
        return (
            as_local(loss.detach()),
            *out_leaves,
            *[g for g in grads if g is not None],
            *new_params,
            *new_states,
            *buffers,
        )

    def _forward_backward(self, tensors: dict, params: list, data: tuple) -> tuple[object, torch.Tensor, list]:
        """The model's output, the loss and the gradients. The backward runs inside the re-parametrisation too:
        activation checkpointing recomputes the forward there and must see the traced parameters, not the
        module's real ones."""
        inputs = tuple(data[:-1]) if self.loss_fn is not None else tuple(data)
        with _reparametrize_module(self.model, tensors, tie_weights=True, strict=False):
            with self.autocast.applied():
                self.phase.current = "forward"
                out = self.model(*inputs)
                self.phase.current = "loss"
                loss = self.loss_fn(out, data[-1]) if self.loss_fn is not None else out
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                raise UnsupportedModelError(
                    "the loss must be a floating-point tensor with one element; "
                    f"got {type(loss).__name__} {getattr(loss, 'shape', '')}. Reduce it (mean or sum) in loss_fn."
                )
            seed = torch.ones_like(loss)
            self.phase.current = "backward"
            grads = _distinct(torch.autograd.grad(loss, params, seed, allow_unused=True))
        return out, loss, grads


def _traced(step_fn: StepFunction, inputs: StepInputs, batch: tuple) -> fx.GraphModule:
    """``step_fn`` traced functional on the step's flat inputs (the real buffers left as they were); a failure
    explained by the part of the step it came from."""
    state, plan = inputs.state, inputs.plan
    # the twins' slots live where the parameters are (a captured program reads them there); the generic
    # path's lrs become floats after tracing
    scalar_device = state.params[0].device if plan.scalars_as_tensors and state.params else torch.device("cpu")
    flat_inputs = [
        *[p.detach().requires_grad_(True) for p in inputs.params],
        *[p.detach() for p in state.frozen],
        *state.buffers,
        *[t for s in inputs.opt_states for t in s],
        *batch,
        *[torch.tensor(v, dtype=torch.float64, device=scalar_device) for v in plan.scalar_values()],
    ]
    snapshot = [t.clone() for t in state.buffers]  # tracing must not touch real buffers
    try:
        with quiet_fake_tensor_failures():
            functional = trace_functional(step_fn, flat_inputs, plan, symbolic_scalars=step_fn.generic)
        check_operand_dtypes(functional.graph)
        return functional
    except (UnsupportedModelError, UnsupportedOptimizerError):
        raise
    except Exception as exc:  # torch raises many kinds while tracing; name the cause plainly
        probed = dict(zip(state.names, [w.detach() for w in inputs.params]))
        probed.update(zip(state.frozen_names, state.frozen))
        probed.update(zip(state.buffer_names, [b.clone() for b in snapshot]))
        raise explain(exc, step_fn.phase.current, step_fn.model, step_fn.loss_fn, batch, probed, step_fn.autocast)  # noqa: B904 - its cause is set
    finally:
        with torch.no_grad():
            for b, s in zip(state.buffers, snapshot):
                b.copy_(s)


def _tag_tensor_parallel(program: StepProgram, model: torch.nn.Module) -> None:
    """Under a tensor-parallel plan: every collective of the trace is the plan's, on the 'tp' group, and the
    update is checked to work on each rank's shards alone."""
    tensor_parallel = tensor_parallel_of(model)
    if tensor_parallel is None:
        return
    check_update(program.graph)
    for node in program.graph.nodes:
        if is_collective(node):
            node.meta["mesh_dim"] = "tp"
    program.decisions["tensor-parallel"] = (
        f"traced through DTensor: {len(tensor_parallel.specs)} parameters are DTensors on 'tp' "
        f"({tensor_parallel.size} ranks); this rank's program holds its shards"
    )


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
