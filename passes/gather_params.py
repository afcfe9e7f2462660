"""``gather-params``: the second half of ZeRO-1 and ZeRO-2, after the passes that wrap the update.

Requires: ``shard-optimizer`` before it, so every parameter output is this rank's updated slice
``p.view(-1)[lo:hi]`` (``program.shards``) and every reduce-scatter's ``collective`` meta holds its bucket's
layout (``grads``, ``starts``, ``length``). Loss scaling and clipping run between the two, on the slices.
Guarantees: each bucket's updated shard is all-gathered (``all_gather_into_tensor``) in bucket order, and every
parameter's new values are copied out of it into the parameter in place, so after the step every rank's parameters hold
the full updated values, as with DDP (``in_place=false``: the new values are the step's outputs, views of the gathered
bucket, which the runtime binds once the step is kept: a DiLoCo sync under a quorum, voted on after it runs, must leave
the parameters as they were when it does not commit). A rank that owns nothing of a bucket sends zeros. A bucket that
``flatten-update`` made flat is gathered whole: the shard its runs wrote is sent, and the gathered bucket is copied
into the flat parameters in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import Cursor
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram

from .flat_writes import laid_out, written_value
from .gradient_flow import before_output, input_node, output_values, set_output_values

aten = torch.ops.aten


@dataclass(frozen=True)
class GatherParams(Pass):
    name = "gather-params"
    requires = frozenset({Fact.FUNCTIONAL, Fact.STATE_SHARDED})
    ensures = frozenset({Fact.WHOLE_PARAMETERS})
    summary = "all-gather each bucket's updated parameter shards and copy them into the parameters"
    in_place: bool = option(True, help="copy the gathered values into the parameters; false: they are the outputs")

    def run(self, program: StepProgram) -> bool:
        kinds = {n.meta["collective"]["kind"] for n in program.graph.nodes if "collective" in n.meta}
        if "all_gather" in kinds:  # gathered already
            return False
        buckets = sharded_buckets(program)
        for bucket in buckets:
            _gather(program, bucket, self.in_place)
        return bool(buckets)


def sharded_buckets(program: StepProgram) -> list[dict]:
    """The ``collective`` meta of every reduce-scatter ``shard-optimizer`` made, in bucket order: ``grads``
    (parameter names), ``starts`` and ``length`` give the bucket's flat layout."""
    return [
        n.meta["collective"]
        for n in program.graph.nodes
        if n.meta.get("collective", {}).get("kind") == "reduce_scatter" and "starts" in n.meta["collective"]
    ]


def rank_shard(
    program: StepProgram,
    cursor: Cursor,
    names: tuple[str, ...],
    starts: tuple[int, ...],
    length: int,
    slices: dict[str, fx.Node],
    meta: dict,
) -> fx.Node:
    """This rank's shard of a bucket laid out as ``names`` at ``starts`` (``length`` elements in all): each
    parameter's slice ``slices[name]`` (its elements ``program.shards[name]``) where it lies, zeros between. A
    rank that owns nothing of the bucket sends zeros."""
    rank, shard = program.rank, length // program.world_size
    pieces = [
        (start + program.shards[n][0], start + program.shards[n][1], slices[n]) for n, start in zip(names, starts)
    ]
    return laid_out(cursor, pieces, rank * shard, (rank + 1) * shard, slices[names[0]], **meta)


def _gather_flat(program: StepProgram, bucket: dict, flat: fx.Node) -> None:
    """All-gather one flat bucket's updated shard (the values its runs wrote, zeros between) into its flat
    parameters."""
    rank, shard = program.rank, bucket["length"] // program.world_size
    comm = {"role": "communication", "bucket": ("params", bucket["bucket"])}
    cursor = before_output(program)
    send = written_value(program, flat, rank * shard, (rank + 1) * shard, cursor, **comm)
    info = {"kind": "all_gather", "bucket": bucket["bucket"], "params": bucket["grads"], "bytes": bucket["bytes"]}
    gathered = cursor.emit(
        C10D.all_gather_into_tensor.default, (send, program.world_size, program.group_name), collective=info, **comm
    )
    cursor.emit(aten.copy_.default, (flat, cursor.emit(WAIT, (gathered,), **comm)), **comm)


def _gather(program: StepProgram, bucket: dict, in_place: bool) -> None:
    """All-gather one bucket's updated shard and copy every parameter's new values into it, in place (else: the
    parameter's output is its view of the gathered bucket)."""
    flat = f"grads{bucket['bucket']}.param"
    if any(b.port == flat for b in program.flat_buffers):
        if not in_place:
            raise ConfigurationError(
                f"gather-params{{in-place=false}}: bucket {bucket['bucket']} is flat ('flatten-update'), and its "
                "parameters are views of one buffer the gather writes. Leave out flatten-update, or in-place=false."
            )
        _gather_flat(program, bucket, input_node(program, Port("flat", flat)))
        return
    names, starts, length = bucket["grads"], bucket["starts"], bucket["length"]
    values = output_values(program)
    where = {port.name: i for i, port in enumerate(program.outputs) if port.kind == "param"}
    cursor = before_output(program)
    comm = {"role": "communication", "bucket": ("params", bucket["bucket"])}
    params = [input_node(program, Port("param", name)) for name in names]
    send = rank_shard(program, cursor, names, starts, length, {n: values[where[n]] for n in names}, comm)
    info = {"kind": "all_gather", "bucket": bucket["bucket"], "params": names, "bytes": bucket["bytes"]}
    gathered = cursor.emit(
        C10D.all_gather_into_tensor.default, (send, program.world_size, program.group_name), collective=info, **comm
    )
    full = cursor.emit(WAIT, (gathered,), **comm)
    for name, param, start in zip(names, params, starts):
        part = cursor.emit(aten.slice.Tensor, (full, 0, start, start + param.meta["val"].numel()), **comm)
        whole = cursor.emit(aten.view.default, (part, list(param.meta["val"].shape)), **comm)
        values[where[name]] = cursor.emit(aten.copy_.default, (param, whole), **comm) if in_place else whole
    set_output_values(program, values)
