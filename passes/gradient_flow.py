"""Where gradients are and where they go: shared by every pass that reads, reduces or rewrites them.

Not a pass. A traced gradient carries ``meta["grad_of"]`` (its parameter).
A pass that reduces it hands the reduced value to the optimizer through
:func:`replace_gradient`, which tags that value ``meta["reduced_grad_of"]``;
a pass that rewrites what the optimizer reads (unscaling, clipping) moves the
tag on with :func:`retarget_optimizer_input`. So "the gradient the optimizer
reads" is always one tagged node per parameter, whatever ran before.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transpiler.graph.edit import Cursor, fake_mode
from transpiler.graph.ports import PARTICIPANTS, ExtraInit, Port, PortKind, is_input
from transpiler.graph.program import StepProgram


def gradient_nodes(program: StepProgram) -> list[fx.Node]:
    """Gradients in the order the backward pass produces them."""
    return [n for n in program.graph.nodes if "grad_of" in n.meta]


def is_reduced(grad: fx.Node) -> bool:
    return any(u.meta.get("role") == "communication" for u in grad.users)


def unreduced_gradients(program: StepProgram) -> list[fx.Node]:
    return [g for g in gradient_nodes(program) if not is_reduced(g)]


def replace_gradient(grad: fx.Node, reduced: fx.Node) -> None:
    """Every reader of ``grad`` reads ``reduced`` instead, except the communication that reduces it and another
    parameter's raw gradient copied from it (equal gradients, see ``tracing._distinct``)."""
    grad.replace_all_uses_with(reduced, delete_user_cb=lambda u: not reads_raw_gradient(u))
    reduced.meta["reduced_grad_of"] = grad.meta["grad_of"]


def reads_raw_gradient(user: fx.Node) -> bool:
    """The communication reducing a gradient, or another parameter's gradient equal to it, reads it raw."""
    return user.meta.get("role") == "communication" or "grad_of" in user.meta


def optimizer_gradients(program: StepProgram) -> dict[str, fx.Node]:
    """Per parameter, in model order, the gradient value the optimizer reads (reduced, unscaled... as passes
    left it). Model order, as ``model.parameters()`` lists them, is the order ``clip_grad_norm_`` sums in."""
    found = {n.meta["grad_of"]: n for n in program.graph.nodes if "grad_of" in n.meta}
    found.update({n.meta["reduced_grad_of"]: n for n in program.graph.nodes if "reduced_grad_of" in n.meta})
    return {p.name: found[p.name] for p in program.inputs if p.kind == "param" and p.name in found}


def retarget_optimizer_input(old: fx.Node, new: fx.Node) -> None:
    """The optimizer reads ``new`` where it read ``old`` (a rewritten gradient); the tag moves along.

    Readers that only inspect the gradient (``meta["inspects"]``: overflow checks, norms) stay on ``old``.
    """
    old.replace_all_uses_with(
        new,
        delete_user_cb=lambda u: u.meta.get("role") == "optimizer" and u is not new and not u.meta.get("inspects"),
    )
    name = old.meta.get("reduced_grad_of", old.meta.get("grad_of"))
    old.meta.pop("reduced_grad_of", None)
    new.meta["reduced_grad_of"] = name


def input_node(program: StepProgram, port: Port) -> fx.Node:
    """The placeholder that feeds ``port``."""
    return next(n for n in program.graph.find_nodes(op="placeholder", sort=False) if n.meta.get("port") == port)


def input_nodes(program: StepProgram) -> dict[Port, fx.Node]:
    """Every port's placeholder: one scan for a pass that looks up many (``input_node`` scans per lookup)."""
    return {n.meta["port"]: n for n in program.graph.find_nodes(op="placeholder", sort=False) if "port" in n.meta}


def add_input(program: StepProgram, port: Port, like: fx.Node | torch.Tensor) -> fx.Node:
    """A new placeholder after the existing ones, with its port (the runtime feeds inputs by port).

    ``like`` is a node whose value it has, or a (fake) tensor of that shape and dtype.
    """
    last = [n for n in program.graph.nodes if n.op == "placeholder"][-1]
    with program.graph.inserting_after(last):
        node = program.graph.placeholder("".join(c if c.isalnum() else "_" for c in f"x_{port.name}"))
    node.meta.update(val=like.meta.get("val") if isinstance(like, fx.Node) else like, port=port)
    program.inputs.append(port)
    return node


def participant_count(program: StepProgram) -> fx.Node:
    """The input ``participants`` (port kind ``quorum``, a 0-d float32): how many take part in this step's mean,
    filled each step by the runtime from a torchft quorum. Added once, read by every pass that divides by it."""
    for node in program.graph.nodes:
        if is_input(node, PortKind.QUORUM) and node.meta["port"].name == PARTICIPANTS:
            return node
    return add_input(program, Port(PortKind.QUORUM, PARTICIPANTS), fake_tensor(program, torch.float32))


def add_state(program: StepProgram, name: str, like: fx.Node | torch.Tensor, init: ExtraInit) -> fx.Node:
    """An ``extra`` input: state a pass keeps from step to step (the runtime holds it, checkpoints carry it),
    made before the first step by the rule ``init`` (``program.extra_init``: ``ExtraInit.zeros_like(name)``,
    ``ExtraInit.scalar(0, "int64")``...). A tensor ``like`` is placed where ``init`` puts the real value (the
    parameters' device; the CPU for a host copy), so the graph says where it lives: a CUDA capture refuses a CPU
    value that feeds the device."""
    program.extra_init[name] = init
    if isinstance(like, torch.Tensor):
        device = torch.device("cpu") if init.on_host else parameters_device(program)
        if like.device != device:
            with fake_mode(program.graph):
                like = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
    return add_input(program, Port("extra", name), like)


def add_constant(program: StepProgram, name: str, value: torch.Tensor, **meta) -> fx.Node:
    """A tensor baked into the program (a ``get_attr`` of its GraphModule, not saved in checkpoints), after the
    inputs. Names must be new: the module attribute is the constant."""
    if hasattr(program.graph_module, name):
        raise ValueError(f"the program already has an attribute '{name}'")
    program.graph_module.register_buffer(name, value, persistent=False)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    with program.graph.inserting_after(placeholders[-1]):
        node = program.graph.get_attr(name)
    node.meta.update(val=fake_mode(program.graph).from_tensor(value), **meta)
    return node


def add_outputs(program: StepProgram, values: list[fx.Node], ports: list[Port]) -> None:
    """Append graph outputs with their ports (extra state, metrics)."""
    output = program.graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(values),)
    program.outputs = list(program.outputs) + list(ports)


def output_values(program: StepProgram) -> list[fx.Node]:
    return list(program.graph.output_node().args[0])


def set_output_values(program: StepProgram, values: list[fx.Node]) -> None:
    program.graph.output_node().args = (tuple(values),)


def fake_tensor(program: StepProgram, dtype: torch.dtype, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """A fake tensor in the graph's fake mode (0-d by default), for the value of a new input."""
    with fake_mode(program.graph):
        return torch.empty(shape, dtype=dtype)


def parameters_device(program: StepProgram) -> torch.device:
    """The device of the program's parameters (the CPU for a program without any)."""
    for node in program.graph.nodes:
        port = node.meta.get("port")
        if node.op == "placeholder" and port is not None and port.kind == "param":
            return node.meta["val"].device
    return torch.device("cpu")


def before_output(program: StepProgram) -> Cursor:
    """A cursor that emits nodes just before the graph's output, in order."""
    return Cursor(program.graph, program.graph.output_node().prev)


def seed_ends(program: StepProgram) -> list[fx.Node]:
    """The loss-gradient seeds as the backward reads them: the end of each ``loss_grad`` chain (one per microbatch
    of a pipeline's last stage, one in any other step), where the forward and the loss are done and the backward
    starts. A pipeline stage before the last has none: the gradients it receives carry the seed's scaling."""
    ends = [
        n
        for n in program.graph.nodes
        if n.meta.get("role") == "loss_grad" and not any(u.meta.get("role") == "loss_grad" for u in n.users)
    ]
    stage = program.stage
    if not ends and (stage is None or stage.rank == stage.world_size - 1):
        raise ValueError("the step has no loss-gradient seed node (role 'loss_grad')")
    return ends


def seed_end(program: StepProgram) -> fx.Node:
    """The first loss-gradient seed (see :func:`seed_ends`)."""
    return seed_ends(program)[0]


def scale_seed(program: StepProgram, factor: float | fx.Node, *, inverse: bool = False, **meta) -> list[fx.Node]:
    """Multiply each loss-gradient seed (after any scaling already there) by ``factor`` (``inverse``: by
    ``reciprocal(factor)``, a node); returns the new seeds.

    The seed is ``ones_like(loss)`` with role ``loss_grad``; each scaling adds one ``mul`` at the end of that
    chain, so passes that scale it (1/world size, 1/accumulation steps, the loss scale) compose in any order.
    """
    ends = seed_ends(program)
    if isinstance(factor, fx.Node) and ends:
        cursor = Cursor(program.graph, factor)
        if inverse:  # in the factor's dtype, as 1/world_size is a float32 constant for a float32 seed
            factor = cursor.emit(torch.ops.aten.reciprocal.default, (factor,), role="loss_grad")
        if factor.meta["val"].dtype != ends[0].meta["val"].dtype:
            dtype = ends[0].meta["val"].dtype
            factor = cursor.emit(torch.ops.aten._to_copy.default, (factor,), {"dtype": dtype}, role="loss_grad")
    scaled = []
    for end in ends:
        scaled.append(
            Cursor(program.graph, end).emit(torch.ops.aten.mul.Tensor, (end, factor), role="loss_grad", **meta)
        )
        end.replace_all_uses_with(scaled[-1], delete_user_cb=lambda user: user is not scaled[-1])
    return scaled


def keep_inputs(program: StepProgram, kinds: tuple[str, ...], names: set[str] | None = None) -> None:
    """Outputs of these kinds (for these names) return their inputs unchanged: the update is dropped."""
    values = output_values(program)
    for i, port in enumerate(program.outputs):
        owner = port.name.rsplit(".", 1)[0] if port.kind == "state" else port.name
        if port.kind in kinds and (names is None or owner in names):
            values[i] = input_node(program, port)
    set_output_values(program, values)
    program.graph.eliminate_dead_code()
