"""Which stage of a pipeline each node of a traced step belongs to, read from the marks the tracer left.

A node's *home* is the stage whose values it reads: ``stage_input(x, k)`` starts stage ``k``, and its gradient
mark ``stage_input_grad(g, k)`` is read by stage ``k - 1``; any other node is at home where its inputs are. A
node that reads values of two stages crosses a split point (a skip connection around it, or a parameter shared
by two stages): the cut is refused, naming the node. A node whose inputs are only the step's inputs
(parameters, optimizer state, the batch) has no home: it belongs to every stage that needs it (a weight's
transpose, the embedding of the batch in the first stage, the optimizer's scalars).

Nodes of the forward, the loss and the backward that read the batch, a buffer, or a value of the pipeline, run once
per microbatch; the rest (a weight's transpose, the optimizer's update) once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.ports import Port, PortKind
from transpiler.graph.program import StepProgram
from transpiler.graph.stage_ops import STAGE_INPUT, STAGE_INPUT_GRAD

PER_MICROBATCH_ROLES = ("forward", "loss", "loss_grad", "backward")


@dataclass
class StageCut:
    """The stages' shares of one traced step."""

    stages: int
    holders: dict[fx.Node, frozenset[int]]  # every node but the output -> the stages whose programs hold it
    per_microbatch: set[fx.Node]  # the nodes run once per microbatch
    owner: dict[Port, int]  # each output port's stage (the loss: the last)
    inputs: dict[int, fx.Node]  # stage k -> its ``stage_input`` node
    input_grads: dict[int, fx.Node]  # stage k -> its ``stage_input_grad`` node (none: its input takes no gradient)

    def held_by(self, node: fx.Node, stage: int) -> bool:
        return stage in self.holders.get(node, frozenset())


def cut_stages(program: StepProgram, stages: int) -> StageCut:
    """The cut of ``program`` (traced with ``stages - 1`` split points marked) into ``stages`` stages."""
    graph = program.graph
    inputs, input_grads = _marks(graph, stages)
    home: dict[fx.Node, int | None] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            home[node] = None
        elif node.target is STAGE_INPUT:
            home[node] = node.args[1]
        elif node.target is STAGE_INPUT_GRAD:
            home[node] = node.args[1] - 1
        else:
            home[node] = _home_of(node, home)
    owner = _owners(program, home, stages)
    holders = _holders(graph, home, owner, program.outputs)
    _check_parameters(graph, holders, owner)
    return StageCut(stages, holders, _per_microbatch(graph), owner, inputs, input_grads)


def _marks(graph: fx.Graph, stages: int) -> tuple[dict[int, fx.Node], dict[int, fx.Node]]:
    inputs: dict[int, list[fx.Node]] = {}
    grads: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.target is STAGE_INPUT:
            inputs.setdefault(node.args[1], []).append(node)
        elif node.target is STAGE_INPUT_GRAD:
            grads.setdefault(node.args[1], []).append(node)
    for k in range(1, stages):
        count = len(inputs.get(k, []))
        if count != 1:
            raise ConfigurationError(
                f"stage {k}'s split point ran {count} times in the traced forward; each must run once per forward "
                "(a module the forward calls once, on the path from the batch to the loss)."
            )
    extra = sorted(k for k in inputs if not 1 <= k < stages)
    if extra:
        raise ConfigurationError(f"split points mark stages {extra}, outside 1..{stages - 1}.")
    return {k: v[0] for k, v in inputs.items()}, {k: v[0] for k, v in grads.items()}


def _home_of(node: fx.Node, home: dict[fx.Node, int | None]) -> int | None:
    stages = {home[i] for i in node.all_input_nodes if home[i] is not None}
    if len(stages) > 1 and "grad_of" in node.meta:
        raise ConfigurationError(tied(node.meta["grad_of"], sorted(stages)))
    if len(stages) > 1:
        readers = ", ".join(f"{i.name} (stage {home[i]})" for i in node.all_input_nodes if home[i] is not None)
        raise ConfigurationError(
            f"the split points do not cut the step: {node.meta.get('role', '')} op {node.name} "
            f"({getattr(node.target, '__name__', node.target)}) reads values of stages {sorted(stages)}: {readers}. "
            "A value other than a split point's input crosses it (a skip connection around it, or a value kept "
            "from an earlier module). Split at a module whose input is all that later modules read."
        )
    return next(iter(stages), None)


def _owners(program: StepProgram, home: dict[fx.Node, int | None], stages: int) -> dict[Port, int]:
    """Each output port's stage: a parameter's is its gradient's (else where the forward reads it), a buffer's where
    its new value is made (else where it is read); one the graph does not place (BatchNorm's count of batches,
    which only its own update reads; an unused parameter) takes the stage of the tensor of the nearest module that
    has one (the same BatchNorm's running mean), else the first; optimizer state goes with its parameter."""
    graph = program.graph
    placeholder = {n.meta["port"]: n for n in graph.nodes if n.op == "placeholder"}
    grads = {n.meta["grad_of"]: n for n in graph.nodes if "grad_of" in n.meta}
    values = dict(zip(program.outputs, graph.output_node().args[0]))
    owner: dict[Port, int] = {p: stages - 1 for p in values if p.kind == PortKind.LOSS}
    unplaced = []
    for port, value in values.items():
        if port.kind not in (PortKind.PARAM, PortKind.BUFFER, PortKind.FROZEN):
            continue
        found = home.get(grads.get(port.name)) if port.kind == PortKind.PARAM else None
        if found is None and isinstance(value, fx.Node):
            found = home.get(value)
        if found is None and port in placeholder:
            found = _first_reader_stage(placeholder[port], home)
        if found is None:
            unplaced.append(port)
        else:
            owner[port] = found
    placed = {p.name: stage for p, stage in owner.items() if p.kind != PortKind.LOSS}
    for port in unplaced:
        nearest = max(placed, key=lambda name: _shared_prefix(name, port.name), default=None)
        owner[port] = placed[nearest] if nearest is not None and _shared_prefix(nearest, port.name) else 0
    params = {p.name: owner[p] for p in values if p.kind == PortKind.PARAM}
    for port in values:
        if port.kind == PortKind.STATE:
            param = max((p for p in params if port.name.startswith(p + ".")), key=len, default=None)
            owner[port] = params[param] if param is not None else 0
    return owner


def _shared_prefix(a: str, b: str) -> int:
    """How many leading module names two dotted tensor names share (``blocks.2.bn1.x``, ``blocks.2.bn1.y``: 3)."""
    count = 0
    for x, y in zip(a.split(".")[:-1], b.split(".")[:-1]):
        if x != y:
            break
        count += 1
    return count


def _first_reader_stage(node: fx.Node, home: dict[fx.Node, int | None]) -> int | None:
    """The stage of the first node with a home downstream of ``node``."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop(0)
        if user in seen:
            continue
        seen.add(user)
        if home.get(user) is not None:
            return home[user] if user.target is not STAGE_INPUT else user.args[1] - 1
        stack.extend(user.users)
    return None


def _holders(
    graph: fx.Graph, home: dict[fx.Node, int | None], owner: dict[Port, int], outputs: list[Port]
) -> dict[fx.Node, frozenset[int]]:
    """The stages whose programs hold each node: its home, or, for a node without one, every stage that reads it
    (a mark's input is read by the stage that sends it)."""
    holders: dict[fx.Node, frozenset[int]] = {}
    output = graph.output_node()
    by_output: dict[fx.Node, set[int]] = {}
    for port, value in zip(outputs, output.args[0]):
        if isinstance(value, fx.Node):
            by_output.setdefault(value, set()).add(owner[port])
    for node in reversed(graph.nodes):
        if node is output:
            continue
        if home[node] is not None:
            holders[node] = frozenset({home[node]})
            continue
        needed = set(by_output.get(node, ()))
        for user in node.users:
            if user is output:
                continue
            if user.target is STAGE_INPUT:
                needed.add(user.args[1] - 1)
            elif user.target is STAGE_INPUT_GRAD:
                needed.add(user.args[1])
            else:
                needed |= holders[user]
        holders[node] = frozenset(needed)
    return holders


def _check_parameters(graph: fx.Graph, holders: dict[fx.Node, frozenset[int]], owner: dict[Port, int]) -> None:
    """A trainable parameter lives in one stage: one read by two (tied weights) is refused."""
    for node in graph.nodes:
        port = node.meta.get("port") if node.op == "placeholder" else None
        if port is None or port.kind != PortKind.PARAM:
            continue
        if holders[node] - {owner[port]}:
            raise ConfigurationError(tied(port.name, sorted(holders[node])))


def tied(name: str, stages: list[int]) -> str:
    return (
        f"parameter '{name}' is read by stages {stages} (weights tied across a split point?); a trainable "
        "parameter must live in one stage. Untie it, or move the split points so that one stage holds every module "
        "that reads it."
    )


def _per_microbatch(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of the forward, the loss and the backward that read the batch, a buffer or a mark, directly or not
    (a buffer's update, BatchNorm's count of batches too, runs once per microbatch, each reading the one before)."""
    per: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            port = node.meta.get("port")
            if port is not None and port.kind in (PortKind.BATCH, PortKind.BUFFER):
                per.add(node)
            continue
        if node.meta.get("role") not in PER_MICROBATCH_ROLES:
            continue
        if node.target in (STAGE_INPUT, STAGE_INPUT_GRAD) or any(i in per for i in node.all_input_nodes):
            per.add(node)
    return per
