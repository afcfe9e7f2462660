"""``flatten-update``: one optimizer update per bucket, on flat parameters and state.

Requires: gradients reduced in buckets whose flat result carries ``meta["flat_grads"]`` (``fuse-allreduce``
tags it: the names, starts and sizes of the bucket's slots), and the per-parameter update the optimizer was
traced into (the twins, or the generic path's own ``step()``).
Guarantees: for each such bucket,

- the bucket's parameters become views of one flat input, laid out as the gradients are (the same slot
  starts): the runtime binds each parameter's ``.data`` to its view (``program.flat_buffers``), the forward
  reads ``as_strided`` views of it, and the parameter's own input and output go. Under ZeRO-3
  (``shard-params`` before it: each input is this rank's slice, ``meta[WHOLE_SHAPE]``) the flat input is this
  rank's shard of the bucket, laid out as the reduced gradient shard, and the bucket's all-gathers send it;
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

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.bucket_layout import FLAT_GRADS, WHOLE_SHAPE, FlatGrads
from transpiler.graph.edit import Cursor, position, repair_order
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import Port
from transpiler.graph.program import FlatBuffer, StepProgram
from transpiler.graph.views import contiguous_views

from .bucket_views import aliased_to_output, write_into_buffer
from .bucketing import in_group_order
from .gradient_flow import (
    add_input,
    optimizer_gradients,
    output_values,
    retarget_optimizer_input,
    set_output_values,
)
from .update_chains import Chain, chain_of, dtype_device, kind_of, reach_of, runs_of, trace_chain

aten = torch.ops.aten


@dataclass(frozen=True)
class FlattenUpdate(Pass):
    name = "flatten-update"
    requires = frozenset({Fact.FUNCTIONAL, Fact.PER_PARAMETER})
    invalidates = frozenset({Fact.UNFLATTENED})
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
        reach = reach_of(program, grads)
        flattened = set().union(*(_flatten_bucket(program, base, reach) for base in bases))
        if changed or flattened:
            program.graph.eliminate_dead_code()  # once: the per-parameter updates no output reads any more
            _drop_inputs(program, flattened)
            repair_order(program.graph)
        return changed or bool(flattened)


def _flatten_bucket(program: StepProgram, base: fx.Node, reach: dict[fx.Node, str]) -> set[str]:
    """Flatten one bucket's parameters and update, returning their names (their own inputs, unread once the
    dead updates are gone, are for :meth:`FlattenUpdate.run` to drop); or leave it as it is and say why in
    ``decisions``."""
    info: FlatGrads = base.meta[FLAT_GRADS]
    chains = _chains(program, base, info, reach)
    if isinstance(chains, str):
        program.decisions.setdefault("flatten-update", "")
        program.decisions["flatten-update"] += f"{info.tag}: per parameter ({chains}). "
        return set()
    params = [c.placeholder for c in chains]
    value = params[0].meta["val"]
    # ZeRO-3 holds only this rank's slices (shard-params): its flat parameters are the shard, laid out as the
    # reduced gradients; elsewhere every rank holds the bucket whole
    sliced = WHOLE_SHAPE in params[0].meta
    if sliced:
        length, offset, starts = base.meta["val"].numel(), 0, tuple(c.at for c in chains)
        spans = tuple(c.held for c in chains)
    else:
        length, offset, starts, spans = info.length, info.offset, info.starts, tuple((0, n) for n in info.sizes)
    flat_param = _flat_input(program, f"{info.tag}.param", value, length)
    program.flat_buffers.append(
        FlatBuffer(
            f"{info.tag}.param",
            "param",
            "",
            info.names,
            starts,
            tuple(tuple(p.meta["val"].shape) for p in params),
            spans,
            length,
            str(value.dtype).removeprefix("torch."),
            str(value.device),
        )
    )
    for r, run in enumerate(runs_of(chains)):
        _vectorise(program, base, flat_param, offset, r, run, info.tag)
    repair_order(program.graph)  # what read a parameter's summary (a flag over all of them) follows the run's
    _drop_outputs(program, {c.name for c in chains})
    _forward_reads_views(program, flat_param, params, starts)
    if sliced:
        _gather_the_shard(program, flat_param, info.names)
    return {c.name for c in chains}


def _gather_the_shard(program: StepProgram, flat_param: fx.Node, names: tuple[str, ...]) -> None:
    """ZeRO-3's all-gathers of this bucket send the flat shard itself: it holds each slice where the rank's shard
    of the bucket holds it (what lies between, alignment padding, is never read from the gathered buffer)."""
    for node in list(program.graph.nodes):
        info = node.meta.get("collective")
        if isinstance(info, dict) and info.get("kind") == "all_gather" and tuple(info.get("params", ())) == names:
            if node.args[0].meta["val"].shape != flat_param.meta["val"].shape:
                shapes = node.args[0].meta["val"].shape, flat_param.meta["val"].shape
                raise AssertionError(
                    f"'{node.name}' sends {shapes[0]} elements; this rank's flat shard holds {shapes[1]}"
                )
            node.update_arg(0, flat_param)


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
    reach = reach_of(program, read)
    groups: dict[tuple[str, str], list[str]] = {}
    for name, grad in read.items():
        value = grad.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or aliased_to_output(grad):
            continue
        chain = chain_of(program, name, grad, (0, value.numel()), 0)
        if isinstance(chain, str) or trace_chain(chain, outputs, reach):
            return False  # one update that stays per parameter: laying the gradients out would only copy them
        groups.setdefault(dtype_device(grad), []).append(name)
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


def _chains(program: StepProgram, base: fx.Node, info: FlatGrads, reach: dict[fx.Node, str]) -> list[Chain] | str:
    """Each parameter's update chain, or why the bucket cannot be flattened."""
    numel = base.meta["val"].numel()
    grads = _grad_views(base, info)
    outputs = dict(zip(program.outputs, output_values(program)))
    chains = []
    for i, (name, size) in enumerate(zip(info.names, info.sizes)):
        if name not in grads:
            return f"the optimizer does not read '{name}''s gradient as a view of the bucket"
        lo, hi = info.held(i, numel)
        chain = chain_of(program, name, grads[name], (lo, hi), min(max(info.starts[i] + lo - info.offset, 0), numel))
        if isinstance(chain, str):
            return chain
        whole = chain.placeholder.meta.get(WHOLE_SHAPE, chain.placeholder.meta["val"].shape)
        if len(whole) == 0:
            return f"'{name}' is 0-d"
        held = hi - lo if WHOLE_SHAPE in chain.placeholder.meta else size  # ZeRO-3's input is this rank's slice
        if chain.placeholder.meta["val"].numel() != held or dtype_device(chain.placeholder) != dtype_device(base):
            return f"'{name}' is not the size, dtype or device of its slot"
        why = trace_chain(chain, outputs, reach)
        if why:
            return why
        chains.append(chain)
    return chains


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


def _vectorise(
    program: StepProgram, base: fx.Node, flat_param: fx.Node, offset: int, r: int, run: list, bucket: str
) -> None:
    """Run ``run``'s chain once on flat ranges: the parameters' (from ``offset``, where the gradients' first
    element lies in them) and the gradients' range (in the bucket, or in this rank's shard of it), a flat input
    per state entry (a lane buffer for a 0-d one), and write the results back. A sharded run may hold no element
    here: its lanes (step counts) are still updated."""
    first = run[0]
    held = [c for c in run if c.held[1] > c.held[0]]
    lo = held[0].at if held else 0
    hi = held[-1].at + held[-1].held[1] - held[-1].held[0] if held else 0
    starts = tuple(min(max(c.at - lo, 0), hi - lo) for c in run)
    where = max((n for c in run for n in c.nodes), key=position(program.graph).__getitem__)
    cursor = Cursor(program.graph, where)
    env: dict[fx.Node, fx.Node] = {
        first.param: cursor.emit(aten.slice.Tensor, (flat_param, 0, offset + lo, offset + hi), role="optimizer"),
        first.grad: cursor.emit(aten.slice.Tensor, (base, 0, lo, hi), role="optimizer"),
    }
    lanes: set[fx.Node] = set()  # the run's 0-d per-parameter values (a lane buffer each, once flat)
    lane0: dict[fx.Node, fx.Node] = {}  # a lane node -> its flat value's first element
    tag = f"{bucket}.r{r}"
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
        kind = kind_of(node, shape)

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
    """The flattened parameters' own outputs go (their update writes the flat buffers): the per-parameter updates
    are then dead code."""
    values = output_values(program)
    flat = [p.kind in ("param", "state") and _owner(p) in names for p in program.outputs]
    kept = [(p, v) for p, v, gone in zip(program.outputs, values, flat) if not gone]
    program.outputs = [p for p, _ in kept]
    set_output_values(program, [v for _, v in kept])


def _drop_inputs(program: StepProgram, names: set[str]) -> None:
    """The flattened parameters' own inputs go: the flat buffers carry them now."""
    for node in [n for n in program.graph.nodes if n.op == "placeholder"]:
        port = node.meta.get("port")
        if port is not None and port.kind in ("param", "state") and _owner(port) in names:
            if node.users:
                raise AssertionError(f"'{node.name}' is still read by {list(node.users)[:3]}")
            program.graph.erase_node(node)
            program.inputs.remove(port)
