"""``split-stages``: this rank's stage of a pipeline, cut from the whole traced step, over its microbatches.

Requires: a step traced on one microbatch with its split points marked (``transpiler::stage_input``; the tracer's
``split_points``), and the program's axis ``pp`` (its size the number of stages, its rank this stage). Guarantees:
the program holds only this stage's forward, backward and update, and its inputs and outputs only this stage's
parameters, state and buffers (the batch and the optimizer's scalars stay). The batch comes in whole and is cut
along dim 0 into ``microbatches`` equal parts (``tensor_split``, as ``torch.distributed.pipelining`` cuts it); the
stage runs its actions in the schedule's order (``graph/stage_orders.py``; a zero-bubble order's backward in two:
the gradient of the stage's input, which the stage before waits for, and the rest), receiving each forward's input
from the stage before and each backward's output gradient from the stage after (``transpiler::recv``), sending what
the other stages read (``transpiler::send``, waited for at the end). Each microbatch's gradient of a parameter is
added in microbatch order and the sum divided once by ``microbatches``: ``torch.distributed.pipelining``'s
arithmetic (each microbatch's loss backpropagated unscaled, ``scale_grads``), so the update reads the mean over
microbatches as one gradient node per parameter (``grad_of``) for the passes after it. The loss is the mean of the
microbatches' losses, made on the last stage and summed over the pipeline's group (the other stages add zero), so
every rank returns it. A buffer (BatchNorm's statistics) goes from one microbatch's forward to the next. The names
of every stage's trained parameters stay in ``program.pipeline_grads`` (a global norm sums over all of them)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.edit import ancestors, emit, fake_mode
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.ports import PortKind
from transpiler.graph.program import Axis, StepProgram
from transpiler.graph.stage_ops import RECV, SEND, STAGE_INPUT, STAGE_INPUT_GRAD, WAIT_SENDS
from transpiler.graph.stage_orders import SCHEDULES, Action, label, stage_order

from .gradient_flow import optimizer_gradients
from .stage_balance import balance, keep_marks, segment_costs
from .stage_cut import StageCut, cut_stages

FORWARD_ROLES = ("forward", "loss", "loss_grad")
KEPT_EVERYWHERE = (PortKind.BATCH, PortKind.SCALAR, PortKind.LOSS)
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class SplitStages(Pass):
    name = "split-stages"
    summary = "this rank's pipeline stage of the traced step, over microbatches in a schedule's order"
    microbatches: int = option(1, minimum=1, help="equal parts the batch is cut into along dim 0")
    schedule: str = option("1f1b", choices=SCHEDULES, help="the order of the stage's forwards and backwards")
    virtual: int = option(1, minimum=1, help="chunks of the model per rank (interleaved_1f1b: 2 or more)")
    candidates: str = option(
        "", help="the marked modules, comma-separated, where the trace marks every block: the cut balances them"
    )

    def run(self, program: StepProgram) -> bool:
        axis = program.axes.get("pp")
        if axis is None:
            raise ConfigurationError("split-stages needs the program's axis 'pp' (a pipeline's stages).")
        if any(n.target is SEND for n in program.graph.nodes):
            return False
        ranks = axis.world_size
        order = stage_order(self.schedule, ranks, self.microbatches, axis.rank, self.virtual)
        if self.candidates:
            self._balance(program, ranks * self.virtual)
        cut = cut_stages(program, ranks * self.virtual)
        program.pipeline_grads = tuple(optimizer_gradients(program))
        StageBuilder(program, cut, axis, self.microbatches).build(order)
        program.stage = axis
        held = ", ".join(str(c) for c in range(axis.rank, cut.stages, ranks))
        chunks = f" (chunks {held})" if self.virtual > 1 else ""
        program.decisions["split-stages"] = (
            f"stage {axis.rank} of {ranks}{chunks}, {self.microbatches} microbatches, {self.schedule}: "
            + " ".join(label(action, ranks) for action in order)
        )
        return True

    def _balance(self, program: StepProgram, chunks: int) -> None:
        """Keep the candidates' marks where the chunks' estimated times balance (``stage_balance.py``)."""
        names = self.candidates.split(",")
        cut = balance(*segment_costs(program, self.microbatches), chunks)
        keep_marks(program, cut.starts)
        times = ", ".join(f"{s * 1e3:.2f}" for s in cut.stage_seconds())
        held = ", ".join(f"{b / 2**20:.2f}" for b in cut.stage_bytes())
        program.decisions["balanced-split"] = (
            f"split points {[names[s - 1] for s in cut.starts]}: estimated ms per step by stage {times}; "
            f"MiB of parameters, optimizer state and buffers {held}"
        )


class StageBuilder:
    """Writes one rank's program into a new graph, action by action, then puts it in place of the old one. The
    rank runs the chunks ``axis.rank``, ``axis.rank + ranks``, ... of the cut (one, but for an interleaved
    schedule); chunk ``c``'s peers are the ranks of chunks ``c - 1`` and ``c + 1``."""

    def __init__(self, program: StepProgram, cut: StageCut, axis: Axis, microbatches: int) -> None:
        self.program, self.cut, self.group, self.m = program, cut, axis.group_name, microbatches
        self.ranks = axis.world_size
        self.chunks = tuple(range(axis.rank, cut.stages, axis.world_size))
        self.old = program.graph
        self.new = fx.Graph()
        self.last = cut.stages - 1 in self.chunks
        self.step_env: dict[fx.Node, fx.Node] = {}
        self.envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(microbatches)]
        self.pieces: dict[fx.Node, fx.Node] = {}  # a batch input -> its tensor_split
        self.sums: dict[fx.Node, fx.Node] = {}  # a gradient node of this rank -> its running sum
        # a gradient reduced over the tensor-parallel group (a Partial one): its partial sum -> the all-reduce and wait
        self.reduced: dict[fx.Node, list[fx.Node]] = {}
        self.tokens: list[fx.Node] = []
        self.message: fx.Node | None = None  # the last send or receive: the next one reads it (``after``)
        nodes = [n for n in self.old.nodes if n.op not in ("placeholder", "output")]
        per = cut.per_microbatch
        self.forward, self.backward, self.input_grad, self.weight_grad, self.grads = {}, {}, {}, {}, {}
        for c in self.chunks:
            held = [n for n in nodes if cut.held_by(n, c)]
            self.forward[c] = [n for n in held if n in per and n.meta.get("role") in FORWARD_ROLES]
            backward = [n for n in held if n in per and n.meta.get("role") == "backward"]
            for grad in (n for n in backward if "grad_of" in n.meta):
                reduction = partial_reduction(grad, per)
                if reduction:
                    self.reduced[reduction[0].args[0]] = reduction
            deferred = {n for reduction in self.reduced.values() for n in reduction}
            backward = [n for n in backward if n not in deferred]
            self.backward[c] = backward
            self.grads[c] = [n for n in backward if "grad_of" in n.meta or n in self.reduced]
            # a zero-bubble order's backward in two: what the gradient the chunk before waits for needs (B), the rest
            sent = [n for n in backward if any(u.target is STAGE_INPUT_GRAD and u.args[1] == c for u in n.users)]
            needed = ancestors(sent)
            self.input_grad[c] = [n for n in backward if n in needed]
            self.weight_grad[c] = [n for n in backward if n not in needed]
        mine = [n for n in nodes if any(cut.held_by(n, c) for c in self.chunks)]
        self.once = [n for n in mine if n not in per and n.meta.get("role") != "optimizer"]
        self.update = [n for n in mine if n not in per and n.meta.get("role") == "optimizer"]
        outputs = self.old.output_node().args[0]
        self.buffers = {
            ph: value
            for ph in self.old.nodes
            if ph.op == "placeholder" and ph.meta["port"].kind == PortKind.BUFFER
            for port, value in zip(program.outputs, outputs)
            if port == ph.meta["port"] and isinstance(value, fx.Node) and value in per and value.op != "placeholder"
        }

    def build(self, order: list[Action]) -> None:
        self._placeholders()
        self._copy(self.once, self.step_env, None)
        split = any(kind == "W" for kind, _, _ in order)
        parts = {"F": self.forward, "B": self.input_grad if split else self.backward, "W": self.weight_grad}
        for kind, i, c in order:
            self._copy(parts[kind][c], self.envs[i], i, label((kind, i, c), self.ranks))
            if kind == ("W" if split else "B"):
                self._accumulate(i, c)
        self._finish()

    def _mine(self, owner: int | None) -> bool:
        return owner in self.chunks

    def _rank_of(self, chunk: int) -> int:
        return chunk % self.ranks

    def _tag(self, i: int | None, boundary: int, direction: int) -> int:
        """A message's tag: one per microbatch, chunk boundary (the chunk whose input it is) and direction."""
        return 2 * ((i or 0) * self.cut.stages + boundary) + direction

    # -------------------------------------------------------------- inputs
    def _placeholders(self) -> None:
        outputs = dict(zip(self.program.outputs, self.old.output_node().args[0]))
        kept = []
        for node in self.old.nodes:
            if node.op != "placeholder":
                continue
            port = node.meta["port"]
            if port.kind not in KEPT_EVERYWHERE and not (
                any(self.cut.held_by(node, c) for c in self.chunks)
                or self._mine(self.cut.owner.get(port))
                and port in outputs
            ):
                continue
            copy = self.new.placeholder(node.name)
            copy.meta.update(node.meta)
            if port.kind == PortKind.BATCH:
                val = node.meta["val"]
                with fake_mode(self.old):
                    copy.meta["val"] = torch.empty((val.shape[0] * self.m, *val.shape[1:]), dtype=val.dtype)
            self.step_env[node] = copy
            kept.append(port)
        self.program.inputs = kept

    def _item(self, pieces: fx.Node, i: int) -> fx.Node:
        return emit(self.new, operator.getitem, (pieces, i), role="forward", microbatch=i)

    # -------------------------------------------------------------- actions
    def _copy(self, nodes: list[fx.Node], env: dict[fx.Node, fx.Node], i: int | None, action: str = "") -> None:
        """Copy ``nodes`` in order, reading ``env`` (this microbatch's values), then the step's; each copy (and
        receive) says which ``action`` of the order it belongs to (``meta["action"]``: ``F0``, ``B3.c2``...)."""

        def read(node: fx.Node) -> fx.Node:
            if node in env:
                return env[node]
            if i is not None and node in self.buffers and i > 0:
                return self.envs[i - 1][self.buffers[node]]
            if i is not None and node.op == "placeholder" and node.meta["port"].kind == PortKind.BATCH:
                env[node] = self._item_of(node, i)
                return env[node]
            return self.step_env[node]

        for node in nodes:
            if node in env:  # a value two of the rank's chunks read (made from the batch alone): made once
                continue
            if node.target is STAGE_INPUT and node.args[1] in self.chunks:
                env[node] = self._recv(node, node.args[1] - 1, i, node.args[1], 0)
            elif node.target is STAGE_INPUT_GRAD and node.args[1] - 1 in self.chunks:
                env[node] = self._recv(node, node.args[1], i, node.args[1], 1)
            else:
                copy = self.new.node_copy(node, read)
                copy.meta.pop("grad_of", None)
                if i is not None:
                    copy.meta["microbatch"] = i
                env[node] = copy
                self._send_if_read_elsewhere(node, copy, i)
            if action:
                env[node].meta["action"] = action

    def _item_of(self, node: fx.Node, i: int) -> fx.Node:
        if node not in self.pieces:
            self.pieces[node] = emit(
                self.new, torch.ops.aten.tensor_split.sections, (self.step_env[node], self.m), role="forward"
            )
        return self._item(self.pieces[node], i)

    def _send_if_read_elsewhere(self, node: fx.Node, copy: fx.Node, i: int | None) -> None:
        """After a value the next chunk starts from (or the gradient the chunk before reads), post its send."""
        for user in node.users:
            boundary = user.args[1] if user.target in (STAGE_INPUT, STAGE_INPUT_GRAD) else None
            if user.target is STAGE_INPUT and boundary not in self.chunks:
                self._send(copy, boundary, i, boundary, 0)
            elif user.target is STAGE_INPUT_GRAD and boundary in self.chunks:
                self._send(copy, boundary - 1, i, boundary, 1)

    def _send(self, value: fx.Node, chunk: int, i: int | None, boundary: int, direction: int) -> None:
        tag = self._tag(i, boundary, direction)
        args = (value, self.group, self._rank_of(chunk), tag, self._after())
        token = emit(self.new, SEND, args, role="communication")
        token.meta["microbatch"] = i
        self.tokens.append(token)
        self.message = token

    def _recv(self, mark: fx.Node, chunk: int, i: int | None, boundary: int, direction: int) -> fx.Node:
        val = mark.meta["val"]
        peer, tag = self._rank_of(chunk), self._tag(i, boundary, direction)
        args = (list(val.shape), val.dtype, val.device, self.group, peer, tag, self._after())
        node = emit(self.new, RECV, args, role="communication")
        node.meta["microbatch"] = i
        self.message = node
        return node

    def _after(self) -> list[fx.Node]:
        return [self.message] if self.message is not None else []

    def _accumulate(self, i: int, chunk: int) -> None:
        """Add microbatch ``i``'s gradients of ``chunk`` to the running sums, in microbatch order."""
        for grad in self.grads[chunk]:
            value = self.envs[i][grad]
            self.sums[grad] = (
                value
                if grad not in self.sums
                else emit(self.new, torch.ops.aten.add.Tensor, (self.sums[grad], value), role="backward")
            )

    # -------------------------------------------------------------- the end
    def _finish(self) -> None:
        update_env = dict(self.step_env)
        for grad, total in self.sums.items():
            mean = emit(self.new, torch.ops.aten.div.Tensor, (total, self.m), role="backward")
            if grad in self.reduced:  # the mean of the partial sums, then their one reduction over the group
                env, reduction = {grad: mean}, self.reduced[grad]
                for node in reduction:
                    env[node] = mean = self.new.node_copy(node, env.__getitem__)
                grad = reduction[-1]  # the wait: the traced gradient
            mean.meta["grad_of"] = grad.meta["grad_of"]
            update_env[grad] = mean
        for node in self.update:
            update_env[node] = self.new.node_copy(node, lambda a: update_env[a])
        loss = self._loss()
        last_env = self.envs[-1]
        values = []
        outputs = []
        for port, value in zip(self.program.outputs, self.old.output_node().args[0]):
            if port.kind == PortKind.LOSS:
                values.append(loss)
                outputs.append(port)
            elif self._mine(self.cut.owner.get(port)):
                values.append(last_env.get(value, update_env.get(value)) if isinstance(value, fx.Node) else value)
                outputs.append(port)
        self.new.output(tuple(values))
        self.program.outputs = outputs
        names = {p.name for p in outputs if p.kind == PortKind.PARAM}
        self.program.param_groups = {n: g for n, g in self.program.param_groups.items() if n in names}
        self.program.graph_module = fx.GraphModule(self.program.graph_module, self.new)

    def _loss(self) -> fx.Node:
        """The mean of the microbatches' losses (the last stage's; zero elsewhere), summed over the group once the
        stage's sends are done: ``wait_sends`` hands a zero the loss adds, so no scheduler (``schedule-collectives``,
        Inductor) can move the all-reduce ahead of a send that a peer waits for before its own all-reduce."""
        loss_node = next(v for p, v in zip(self.program.outputs, self.old.output_node().args[0]) if p.kind == "loss")
        if self.last:
            total = self.envs[0][loss_node]
            for env in self.envs[1:]:
                total = emit(self.new, torch.ops.aten.add.Tensor, (total, env[loss_node]), role="loss")
            local = emit(self.new, torch.ops.aten.div.Tensor, (total, self.m), role="loss")
        else:
            val = loss_node.meta["val"]
            local = emit(
                self.new, torch.ops.aten.zeros.default, ([],), {"dtype": val.dtype, "device": val.device}, role="loss"
            )
        # pinned at the end, where no send waits for a peer that is still busy (hoisted right after the last send,
        # it made the stage wait for its peer's receive: measured 20-30 ms a step under ZB-H1)
        done = emit(self.new, WAIT_SENDS, (self.tokens, local, self._after()), role="communication", pinned=True)
        local = emit(self.new, torch.ops.aten.add.Tensor, (local, done), role="loss") if self.last else done
        summed = emit(self.new, c10d.all_reduce.default, (local, "sum", self.group), role="communication")
        return emit(self.new, c10d.wait_tensor.default, (summed,), role="communication")


def partial_reduction(grad: fx.Node, per_microbatch: set[fx.Node]) -> list[fx.Node]:
    """The all-reduce (and its wait) that makes ``grad`` from a partial gradient over the tensor-parallel group (a
    Partial DTensor's, a norm's weight under sequence parallel), when only the update reads it; else nothing.
    Such a gradient is summed over the microbatches first and reduced once, as eager TP inside
    ``torch.distributed.pipelining`` does (the ``.grad`` stays Partial until the step redistributes it): the same
    bits, and one all-reduce a step instead of one per microbatch."""
    if grad.target is not c10d.wait_tensor.default:
        return []
    reduce = grad.args[0]
    if not (
        isinstance(reduce, fx.Node)
        and reduce.target is c10d.all_reduce.default
        and reduce.args[1] == "sum"
        and reduce.meta.get("mesh_dim") == "tp"
        and len(reduce.users) == 1
        and not any(u in per_microbatch for u in grad.users)
    ):
        return []
    return [reduce, grad]
