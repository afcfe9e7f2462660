"""``shard-params``: ZeRO-3 (FSDP's ``FULL_SHARD``): parameters are held as this rank's shards between steps.

Requires: ``shard-optimizer`` (without ``keep-gradient-buckets``) before it, so every parameter's update runs on
its slice ``[lo, hi)`` (``program.shards``) and every reduce-scatter's ``collective`` meta holds its bucket's
layout (``grads``, ``starts``, ``length``); loss scaling and clipping run between the two, on the slices.
Guarantees:

- every sharded parameter's input is this rank's 1-D slice ``p.view(-1)[lo:hi]`` (the runtime holds the
  parameter that way between steps, ``program.param_buckets``), and its update writes the slice: nothing
  gathers the updated values. ``flatten-update``, after it, makes a bucket's slices views of one flat shard;
- each bucket is all-gathered (``all_gather_into_tensor``) right before the forward first reads one of its
  parameters, and the forward reads views of the gathered buffer, which is freed after its last use. The
  next bucket's all-gather is issued as this one's is waited (prefetch one bucket ahead) on a GPU. Not on the
  CPU: there every all-gather runs alone and is waited at once (``schedule-collectives``: gloo's heap bug), so
  a prefetch would overlap nothing and only hold one more bucket. The issuing side is ``pinned``: hoisting
  every gather to the top would hold the whole model;
- with ``reshard-after-forward`` the backward gathers each bucket again, in backward order with the same
  prefetch, and recomputes from it the views and casts of the parameters it reads (``t``, ``view``,
  ``_to_copy``...), so no gathered buffer lives from the forward into the backward, except the last bucket the
  forward reads: the backward reads it first, right away, so its forward gather is kept (FSDP2 keeps its root
  the same way). Without it every forward buffer is kept until the backward's last use;
- the gradients are reduce-scattered in the same buckets by ``shard-optimizer``, so the slice of the reduced
  gradient this rank receives is the slice of the parameters it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.bucket_layout import WHOLE_SHAPE
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor, position
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import Port
from transpiler.graph.program import ParamBucket, StepProgram
from transpiler.graph.views import contiguous_strides, is_view

from .gather_params import rank_shard, sharded_buckets
from .gradient_flow import input_node

aten = torch.ops.aten
BACKWARD = ("loss_grad", "backward")
# what the backward may recompute from a gathered bucket: views and casts of the parameters, nothing that reads
# an activation (an op reading one is real work, and its result does not hold the gathered storage)
RECOMPUTED = frozenset({aten._to_copy.default, aten.clone.default, aten.detach.default})


@dataclass(frozen=True)
class ShardParams(Pass):
    name = "shard-params"
    requires = frozenset({Fact.FUNCTIONAL, Fact.STATE_SHARDED, Fact.UNFLATTENED})
    ensures = frozenset({Fact.WHOLE_PARAMETERS})
    summary = "hold parameters as this rank's shards; all-gather each bucket right before the forward uses it"
    shards_params = True
    reshard_after_forward: bool = option(
        True,
        help="gather each bucket again for the backward, freeing it after the forward (false: keep the forward's "
        "gathered buckets until the backward is done with them: less communication, more memory)",
    )
    prefetch: int = option(
        1,
        minimum=0,
        help="on a GPU, how many buckets' all-gathers are issued ahead of the one being read (each holds one more "
        "bucket gathered; 0: each is issued where it is needed); on the CPU every all-gather runs alone",
    )

    def run(self, program: StepProgram) -> bool:
        if program.param_buckets:
            return False
        layouts = sharded_buckets(program)
        if not layouts:
            return False
        forward: dict[int, list[fx.Node]] = {}  # bucket -> the model's readers of its parameters, by side
        backward: dict[int, list[fx.Node]] = {}
        for index, layout in enumerate(layouts):
            params = [input_node(program, Port("param", name)) for name in layout["grads"]]
            shapes = tuple(tuple(p.meta["val"].shape) for p in params)
            program.param_buckets.append(ParamBucket(layout["grads"], layout["starts"], layout["length"], shapes))
            sides = [_as_slice(program, p) for p in params]
            forward[index] = [u for f, _ in sides for u in f]
            backward[index] = [u for _, b in sides for u in b]
        # one gather per bucket, kept until the backward is done with it: every bucket without
        # reshard-after-forward, else the last the forward reads, which the backward reads first (FSDP2's root)
        kept = set(forward) if not self.reshard_after_forward else {_last_read(program, forward)} - {None}
        for index in kept:
            forward[index], backward[index] = forward[index] + backward[index], []
        first = _place(program, forward, "forward", self.prefetch)
        if self.reshard_after_forward:
            _regather_for_backward(program, {i: v for i, v in first.items() if i not in kept}, backward, self.prefetch)
        for node in reversed(program.graph.nodes):  # views of parameters a phase does not read
            gathered = node.meta.get("bucket", ("",))[0] == "params"
            if gathered and node.target is aten.as_strided.default and not node.users:
                program.graph.erase_node(node)
        return True


def _last_read(program: StepProgram, forward: dict[int, list[fx.Node]]) -> int | None:
    """The bucket whose first forward reader comes last: the backward reads it first, right after the forward."""
    order = position(program.graph)
    firsts = {i: min(order[r] for r in readers) for i, readers in forward.items() if readers}
    return max(firsts, key=firsts.__getitem__) if firsts else None


def _as_slice(program: StepProgram, param: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """Make ``param``'s placeholder this rank's 1-D slice: the update's readers of ``p.view(-1)[lo:hi]`` read it
    directly. Returns the model's readers of the parameter, forward and backward, still to be re-pointed."""
    name = param.meta["port"].name
    lo, hi = program.shards[name]
    whole = param.meta["val"]
    for flat in [u for u in param.users if u.meta.get("role") == "optimizer"]:
        for piece in [u for u in flat.users if u.meta.get("shard_of") == name]:
            piece.replace_all_uses_with(param)
            program.graph.erase_node(piece)
        if not flat.users:
            program.graph.erase_node(flat)
    with whole.fake_mode:
        param.meta["val"] = torch.empty(hi - lo, dtype=whole.dtype, device=whole.device)
    param.meta[WHOLE_SHAPE] = tuple(whole.shape)
    readers = [u for u in param.users if u.op != "output" and u.meta.get("role") != "optimizer"]
    forward = [u for u in readers if u.meta.get("role") not in BACKWARD]
    return forward, [u for u in readers if u.meta.get("role") in BACKWARD]


def _place(
    program: StepProgram, readers: dict[int, list[fx.Node]], phase: str, prefetch: int
) -> dict[int, dict[str, fx.Node]]:
    """Emit each bucket's all-gather right before its first reader (on a GPU the next ``prefetch`` buckets' are
    issued right after this one is waited) and re-point the readers at views of the gathered parameters; returns
    the views, by bucket and parameter name."""
    order = position(program.graph)
    firsts = {i: min(r, key=order.__getitem__) for i, r in readers.items() if r}
    sequence = sorted(firsts, key=lambda i: order[firsts[i]])
    issued: dict[int, fx.Node] = {}
    views: dict[int, dict[str, fx.Node]] = {}
    for k, index in enumerate(sequence):
        bucket = program.param_buckets[index]
        cursor = Cursor(program.graph, firsts[index].prev)
        if index not in issued:
            issued[index] = _issue(program, cursor, index, phase)
        comm = {"role": "communication", "bucket": ("params", index)}
        full = cursor.emit(WAIT, (issued[index],), **comm)
        views[index] = {  # one view each: as_strided, not a slice and a view of it
            name: cursor.emit(aten.as_strided.default, (full, list(shape), contiguous_strides(shape), start), **comm)
            for name, start, shape in zip(bucket.names, bucket.starts, bucket.shapes)
        }
        ahead = sequence[k + 1 : k + 1 + prefetch] if full.meta["val"].device.type != "cpu" else []
        for later in [i for i in ahead if i not in issued]:
            issued[later] = _issue(program, cursor, later, phase)
        params = {input_node(program, Port("param", name)): view for name, view in views[index].items()}
        for reader in readers[index]:
            for param, view in params.items():
                reader.replace_input_with(param, view)
    return views


def _issue(program: StepProgram, cursor: Cursor, index: int, phase: str) -> fx.Node:
    """This rank's shard of bucket ``index`` (its slices, zeros between) and the all-gather of it, ``pinned``
    where it is emitted."""
    bucket = program.param_buckets[index]
    comm = {"role": "communication", "bucket": ("params", index), "pinned": True}
    slices = {name: input_node(program, Port("param", name)) for name in bucket.names}
    send = rank_shard(program, cursor, bucket.names, bucket.starts, bucket.length, slices, comm)
    itemsize = send.meta["val"].element_size()
    info = {
        "kind": "all_gather",
        "bucket": index,
        "params": bucket.names,
        "bytes": bucket.length * itemsize,
        "phase": phase,
    }
    args = (send, program.world_size, program.group_name)
    return cursor.emit(C10D.all_gather_into_tensor.default, args, collective=info, **comm)


def _regather_for_backward(
    program: StepProgram, forward: dict[int, dict[str, fx.Node]], direct: dict[int, list[fx.Node]], prefetch: int
) -> None:
    """The backward's readers of a bucket (of its parameters, or of views and casts of them the forward made)
    read a second gather of it, and those views and casts recomputed from it."""
    chains: dict[int, list[fx.Node]] = {}
    readers: dict[int, list[fx.Node]] = {}
    for index, bucket_views in forward.items():
        derived = _derived(program.graph, set(bucket_views.values()))
        chains[index] = [n for n in derived if n not in bucket_views.values()]
        later = {u for n in derived for u in n.users if u.meta.get("role") in BACKWARD}
        readers[index] = list(dict.fromkeys(direct[index] + sorted(later, key=lambda u: u.name)))
    for index in direct.keys() - forward.keys():
        readers[index] = direct[index]
    again = _place(program, readers, "backward", prefetch)
    order = position(program.graph)
    for index, bucket_views in again.items():
        env = {forward[index][name]: view for name, view in bucket_views.items()} if index in forward else {}
        last = max(bucket_views.values(), key=order.__getitem__)
        Cursor(program.graph, last).copy(chains.get(index, []), env, prefix="re_", role="backward")
        for original, copy in env.items():
            for reader in [u for u in original.users if u in readers[index]]:
                reader.replace_input_with(original, copy)


def _derived(graph: fx.Graph, views: set[fx.Node]) -> list[fx.Node]:
    """The gathered ``views`` and every forward node computed from them alone through views and casts, in
    graph order."""
    found, out = set(views), []
    for node in graph.nodes:
        if node in found:
            out.append(node)
        elif (
            node.op == "call_function"
            and node.meta.get("role") not in (*BACKWARD, "optimizer")
            and node.all_input_nodes
            and all(i in found for i in node.all_input_nodes)
            and (is_view(node) or node.target in RECOMPUTED)
        ):
            found.add(node)
            out.append(node)
    return out
