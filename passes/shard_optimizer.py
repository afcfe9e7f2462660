"""``shard-optimizer``: ZeRO stages 1 and 2 (DeepSpeed ZeRO, FSDP's ``SHARD_GRAD_OP``) as one rewrite.

Requires: gradient nodes tagged ``grad_of`` (not yet reduced), each rank's share (``scale-loss-grad``
before it), and an optimizer update that is element-wise.
Guarantees:

- gradients are grouped in production order into dtype/size buckets, as ``fuse-allreduce`` groups them. A
  bucket's flat buffer holds each gradient at an aligned start (``graph/bucket_layout.py``) and is padded at
  its end to W equal shards, each starting on an aligned boundary (``padded_length``);
- each bucket is reduce-scattered as soon as its last gradient exists: rank r receives the sum of shard r;
- each parameter's update runs on the elements of it that lie in this rank's shard: the slice
  ``p.view(-1)[lo:hi]``, that slice of the reduced gradient, and optimizer state of ``hi - lo`` elements
  (``program.shards[name] = (lo, hi)``; the runtime holds the state that way, a 0-d ``step`` stays whole).
  Every element of every parameter is updated by exactly one rank (``check_shards`` across ranks);
- the parameter outputs are the updated slices, and each reduce-scatter's ``collective`` meta records its
  bucket's layout (``starts``, ``length``): ``gather-params`` all-gathers them into the parameters after the
  passes that wrap the update (loss scaling, clipping) have run on the slices.

With ``keep-gradient-buckets`` (ZeRO-1) a bucket is a persistent buffer the gradients are produced into
(``bucket_views.py``, DDP's ``gradient_as_bucket_view``). Without it (ZeRO-2) the same buffer is allocated each
step right before the bucket's first gradient, produced into the same way (no packing copy), and freed once
reduce-scattered, so no whole gradient outlives its bucket and no gradient memory is held between steps.

The update must be element-wise: every op that reads a sliced tensor is a pointwise op, a copy or a
``*_like`` factory, and its other tensor inputs are 0-d. One whole-tensor op is taken: the norm of a whole
sliced tensor (``linalg_vector_norm`` to a 0-d value; LAMB's and LARS's trust ratios), which becomes the norm
of the whole tensor through one all-reduce of every slice's norm (``sharded_norms.py``). Any other op that
needs the whole tensor (a norm along a dimension, a matrix product, a reshape: Adafactor, Muon) makes the
pass refuse, naming the op and the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import UnsupportedOptimizerError
from transpiler.graph.bucket_layout import FLAT_GRADS, FlatGrads
from transpiler.graph.collectives import C10D, WAIT, is_collective
from transpiler.graph.cost_model import LinkCost
from transpiler.graph.edit import Cursor, node_bytes, position, refresh_value, repair_order
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, ReducingPass
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram

from .bucket_views import write_into_buffer
from .bucketing import (
    DEFAULT_CAP_MB,
    MB,
    BucketedGradientPass,
    across_option,
    bucket_cap_option,
    caps_in_bytes,
    in_group_order,
    placed_buckets,
    sum_across,
)
from .gradient_flow import input_node, replace_gradient
from .sharded_norms import norms_over_ranks
from .update_chains import SHAPE_FOLLOWING

aten = torch.ops.aten


@dataclass(frozen=True)
class ShardOptimizer(BucketedGradientPass):
    name = "shard-optimizer"
    requires = ReducingPass.requires | {Fact.PER_PARAMETER, Fact.UPDATED_LOCALLY}
    ensures = frozenset({Fact.REDUCED, Fact.STATE_SHARDED})
    invalidates = frozenset({Fact.UNREDUCED, Fact.WHOLE_PARAMETERS})  # each rank updates its slices
    summary = "reduce-scatter gradients in buckets, update this rank's shard of parameters and state, all-gather"
    shards_state = True
    keep_gradient_buckets: bool = option(
        True,
        help="persistent full-size gradient buckets (ZeRO-1); false: a bucket lives only until it is "
        "reduce-scattered (ZeRO-2)",
    )
    bucket_cap_mb: float | str = bucket_cap_option(
        ("layer", "the largest module's gradients, at most 25 MiB"),
        (
            "cost",
            "whole modules, a unit started by each module whose bytes are worth a collective of their own (on the "
            "all-gather cost measured at startup), at most 25 MiB (zero3's default)",
        ),
    )
    module_buckets: bool = option(
        False,
        help="cut buckets only between modules, so a layer's parameters share one bucket (ZeRO-3 gathers the "
        "parameters by bucket: a layer then needs one gather)",
    )
    across: bool = across_option("each rank's reduced shard")

    def reduce(self, program: StepProgram, grads: list[fx.Node]) -> None:
        flat_params = [g for g in grads if g.meta["val"].dim() == 0]
        if flat_params:
            raise UnsupportedOptimizerError(
                f"parameter '{flat_params[0].meta['grad_of']}' is 0-d; a sharded optimizer cuts parameters into "
                "1-D slices. Make it a 1-element tensor (nn.Parameter(torch.tensor([v]))), or use fused_allreduce."
            )
        modules = [g.meta["grad_of"].rpartition(".")[0] for g in grads]
        cap, first, alone_from = self._caps(program, grads, modules)
        groups = modules if self.module_buckets else None
        for index, members, cursor in placed_buckets(program, grads, cap, first, groups, alone_from):
            nodes = [grads[i] for i in members]
            order = in_group_order(program, [n.meta["grad_of"] for n in nodes])
            self._reduce_scatter(program, [nodes[i] for i in order], index, cursor)
        _update_shards(program)

    @property
    def wants_link_cost(self) -> bool:
        return self.bucket_cap_mb == "cost"

    def _caps(self, program: StepProgram, grads: list[fx.Node], modules: list[str]) -> tuple[int, int, float]:
        """The caps in bytes, and the bytes from which a module starts a bucket of its own: as given; with
        ``cost`` a module starts a unit where its bytes are worth a collective (:func:`unit_threshold`, on the
        measured all-gather cost), at most 25 MiB a unit; in a world of one, where nothing moves, units fill to
        that bound; ``layer`` where there is nothing to measure; with ``layer`` the bytes of the module with the
        most gradient bytes, at most DDP's 25 MiB, for the first bucket too. Either way ZeRO-3 gathers whole
        modules; one bucket for a large model would hold it whole in every step."""
        never = float("inf")
        bound = int(DEFAULT_CAP_MB * MB)
        if self.bucket_cap_mb == "cost" and program.world_size == 1:
            program.decisions[self.name] = (
                "bucket_cap_mb=cost in a world of one: nothing moves between ranks, so one more gather unit only "
                f"adds its collectives' dispatch to the step: modules share a unit up to {DEFAULT_CAP_MB:g} MiB"
            )
            return bound, bound, never
        if self.bucket_cap_mb == "cost" and program.link_cost is not None:
            threshold, why = unit_threshold(program.link_cost)
            program.decisions[self.name] = why
            return bound, bound, threshold
        if self.bucket_cap_mb not in ("layer", "cost"):
            return (*caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb), never)
        per_module: dict[str, int] = {}
        for grad, module in zip(grads, modules):
            per_module[module] = per_module.get(module, 0) + node_bytes(grad)
        module, largest = max(per_module.items(), key=lambda item: item[1])
        cap_mb = min(DEFAULT_CAP_MB, largest / MB)
        said = f"bucket_cap_mb=layer: {cap_mb:.3g} MiB, the gradients of '{module or '(the model)'}', the largest "
        said += f"module (at most {DEFAULT_CAP_MB:g} MiB)"
        if self.bucket_cap_mb == "cost":
            fell_back = "bucket_cap_mb=cost fell back to layer (no all-gather cost: it is measured only in a world of "
            said = fell_back + "more than one process); " + said
        program.decisions[self.name] = said
        cap, first = caps_in_bytes(cap_mb, self.first_bucket_mb)
        return cap, min(first, cap), never

    def _reduce_scatter(self, program: StepProgram, nodes: list[fx.Node], index: int, cursor: Cursor) -> None:
        world, rank = program.world_size, program.rank
        comm = {"role": "communication", "bucket": ("grads", index)}
        persistent = self.keep_gradient_buckets
        flat, starts = write_into_buffer(program, nodes, "grads", index, cursor, shards=world, persistent=persistent)
        sizes = [n.meta["val"].numel() for n in nodes]
        itemsize = nodes[0].meta["val"].element_size()
        length = flat.meta["val"].numel()
        names = [n.meta["grad_of"] for n in nodes]
        info = {
            "kind": "reduce_scatter",
            "bucket": index,
            "grads": tuple(names),
            "bytes": length * itemsize,
            "padding_bytes": (length - sum(sizes)) * itemsize,
            "starts": tuple(starts),
            "length": length,
        }
        shard = length // world
        mine = _scatter_sum(program, cursor, flat, shard, info, comm)
        if self.across:
            mine = sum_across(program, cursor, mine, index, comm)
        mine.meta[FLAT_GRADS] = FlatGrads(
            f"grads{index}", tuple(names), tuple(starts), tuple(sizes), length, rank * shard
        )
        for node, start, n in zip(nodes, starts, sizes):
            lo, hi = owned(start, n, rank, shard)
            begin = start + lo - rank * shard if hi > lo else 0
            piece = cursor.emit(
                aten.slice.Tensor, (mine, 0, begin, begin + hi - lo), grad_slot=node.meta["grad_of"], **comm
            )
            replace_gradient(node, piece)
            program.shards[node.meta["grad_of"]] = (lo, hi)
        program.shard_axis = self.axis


def _scatter_sum(program: StepProgram, cursor: Cursor, flat: fx.Node, shard: int, info: dict, comm: dict) -> fx.Node:
    """This rank's shard of the sum over ranks of ``flat``: a reduce-scatter (NCCL). On the CPU an all-to-all
    and a local sum of the W chunks received instead: torch 2.13's gloo has no reduce-scatter of its own (it
    clones the buffer, all-reduces all of it and copies a chunk out), and the all-to-all moves 1/W of the bytes
    (19.5 against 29.0 ms for the benchmark MLP's buckets at W=2, docs/memory.md). At W=2 the sum is the same one
    addition, so the bits are gloo's; beyond, the W chunks are added in rank order. The collective's meta kind
    stays ``reduce_scatter``."""
    world, group = program.world_size, program.group_name
    if flat.meta["val"].device.type != "cpu":
        scatter = C10D.reduce_scatter_tensor.default
        return cursor.emit(WAIT, (cursor.emit(scatter, (flat, "sum", world, group), collective=info, **comm),), **comm)
    splits = [shard] * world
    exchanged = cursor.emit(C10D.all_to_all_single.default, (flat, splits, splits, group), collective=info, **comm)
    received = cursor.emit(WAIT, (exchanged,), **comm)
    chunks = cursor.emit(aten.view.default, (received, [world, shard]), **comm)
    return cursor.emit(aten.sum.dim_IntList, (chunks, [0]), **comm)


def owned(start: int, size: int, rank: int, shard: int) -> tuple[int, int]:
    """The elements ``[lo, hi)`` of a parameter at ``start`` (``size`` elements) in shard ``rank`` of a flat
    buffer cut into shards of ``shard`` elements; ``lo == hi`` when none are."""
    lo = min(max(rank * shard - start, 0), size)
    return lo, max(min((rank + 1) * shard - start, size), lo)


def _update_shards(program: StepProgram) -> None:
    """Every sharded parameter's update runs on its slice: the parameter's optimizer readers read
    ``p.view(-1)[lo:hi]``, state shaped as the parameter becomes a 1-D input of ``hi - lo`` elements, and
    every optimizer op downstream is re-shaped (it must be element-wise)."""
    owner: dict[fx.Node, str] = {}  # sliced value -> the parameter it belongs to
    gradients = {n.meta["reduced_grad_of"]: n for n in program.graph.nodes if "reduced_grad_of" in n.meta}
    for name, (lo, hi) in program.shards.items():
        param = input_node(program, Port("param", name))
        value = param.meta["val"]
        at = Cursor(program.graph, param)
        flat = at.emit(aten.view.default, (param, [-1]), role="optimizer")
        piece = at.emit(aten.slice.Tensor, (flat, 0, lo, hi), role="optimizer", shard_of=name)
        for reader in [u for u in param.users if u.meta.get("role") == "optimizer" and u is not flat]:
            reader.replace_input_with(param, piece)
        owner[piece] = owner[gradients[name]] = name
        for port in program.inputs:
            if port.kind != "state" or port.name.rsplit(".", 1)[0] != name:
                continue
            state = input_node(program, port)
            if state.meta["val"].shape == value.shape:
                with value.fake_mode:
                    state.meta["val"] = torch.empty(hi - lo, dtype=state.meta["val"].dtype, device=value.device)
                owner[state] = name
    norms: list[tuple[fx.Node, str]] = []  # whole-tensor norms of sliced values: summed over the ranks below
    for node in program.graph.nodes:
        sliced = [owner[i] for i in node.all_input_nodes if i in owner]
        if node in owner or not sliced or node.op != "call_function" or node.meta.get("role") != "optimizer":
            continue
        if _is_whole_norm(node):
            norms.append((node, sliced[0]))
            refresh_value(program.graph, node)  # the norm of this rank's slice, for now
            continue
        _check_elementwise(node, sliced[0], owner)
        try:
            refresh_value(program.graph, node)
        except RuntimeError as exc:
            raise UnsupportedOptimizerError(
                f"the update of '{sliced[0]}' combines its slice with a tensor shaped as the whole parameter in "
                f"'{node.name}' ({node.target}), so it cannot run on a shard: {str(exc).splitlines()[0][:200]}"
            ) from exc
        owner[node] = sliced[0]
    if norms and program.world_size > 1:
        _norms_over_ranks(program, norms)


def _is_whole_norm(node: fx.Node) -> bool:
    """``linalg_vector_norm`` of a whole tensor to a 0-d value (LAMB's and LARS's per-tensor trust ratios)."""
    if node.target is not aten.linalg_vector_norm.default:
        return False
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    return dim is None and node.meta["val"].dim() == 0


def _norms_over_ranks(program: StepProgram, norms: list[tuple[fx.Node, str]]) -> None:
    """Every whole-tensor norm of a sliced value becomes the norm of the whole tensor: the slices' norms, one
    all-reduce for all of them per norm order (``sharded_norms.py``), then each reader of a norm reads its
    entry. The updates wait for that all-reduce (``repair_order``), as they wait for a clipping norm."""
    order = position(program.graph)
    by_type: dict[float, list[tuple[fx.Node, str]]] = {}
    for node, name in norms:
        ord_ = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
        by_type.setdefault(float(ord_), []).append((node, name))
    for norm_type, group in by_type.items():
        cursor = Cursor(program.graph, max((n for n, _ in group), key=order.__getitem__))
        readers = {node: list(node.users) for node, _ in group}
        partial = [
            node
            if program.shards[name][1] > program.shards[name][0]
            # an empty slice contributes nothing (and has no inf-norm): a zero
            else cursor.emit(aten.new_zeros.default, (node, []), role="optimizer")
            for node, name in group
        ]
        total = norms_over_ranks(program, cursor, partial, norm_type, tuple(name for _, name in group))
        for i, (node, _) in enumerate(group):
            whole = cursor.emit(aten.select.int, (total, 0, i), role="optimizer")
            for reader in readers[node]:
                reader.replace_input_with(node, whole)
    repair_order(program.graph, [n for n in program.graph.nodes if is_collective(n)])


def _check_elementwise(node: fx.Node, name: str, owner: dict[fx.Node, str]) -> None:
    pointwise = torch.Tag.pointwise in getattr(node.target, "tags", ())
    whole = [
        i.name
        for i in node.all_input_nodes
        if i not in owner and isinstance(i.meta.get("val"), torch.Tensor) and i.meta["val"].dim() > 0
    ]
    if (pointwise or node.target in SHAPE_FOLLOWING) and not whole:
        return
    raise UnsupportedOptimizerError(
        f"the optimizer's update of '{name}' runs {node.target} ('{node.name}'), which needs the whole tensor "
        f"({'it also reads ' + ', '.join(whole) if whole else 'not an element-wise op'}). A sharded mode updates "
        "each rank's slice of every parameter, so only element-wise optimizers (SGD, Adam, AdamW, RMSprop, "
        "Adagrad, NAdam...) run there, and those that also take whole-tensor norms (LAMB, LARS). Use "
        "fused_allreduce for this optimizer."
    )


def unit_threshold(link: LinkCost) -> tuple[int, str]:
    """ZeRO-3's gather units on the measured all-gather cost: consecutive whole modules share a unit until the
    next one is worth a collective of its own, at most 25 MiB a unit. Returns the bytes from which a module
    starts a unit, and the decision, in words.

    Where collectives run behind the compute (a GPU), one more unit costs its collectives' starts (alpha) and
    lets the next gather overlap: a module of at least Hockney's n½ = alpha / beta bytes starts a unit, and the
    smaller modules after it join that unit. n½ is rounded to a power of two, so that timing noise seldom moves
    it. Where nothing overlaps (the CPU: every all-gather runs alone), one more unit only adds its three
    collectives' starts and the waits for the slower rank to the step (about 2.5 ms a unit on the wide GPT of
    ``bench/fsdp.py``, against the probe's 0.3 ms per start), so modules join a unit up to the bound."""
    bound = int(DEFAULT_CAP_MB * MB)
    cost = f"bucket_cap_mb=cost: an all-gather costs {link.alpha * 1e6:.0f} us + {link.beta * 1e9:.3g} ns per byte"
    if not link.overlaps:
        why = (
            f"{cost}, and here nothing runs behind it (every all-gather alone, on the CPU), so one more gather unit "
            f"only adds its collectives' starts to the step: modules share a unit up to {DEFAULT_CAP_MB:g} MiB"
        )
        return bound, why
    half = link.half_bytes
    threshold = 1 << round(math.log2(max(half, 1.0))) if math.isfinite(half) else bound
    why = (
        f"{cost}, so a module of {threshold / 1024:.4g} KiB or more (n½ = {half / 1024:.0f} KiB, rounded to a "
        f"power of two) starts a gather unit and smaller ones join the unit before them, at most "
        f"{DEFAULT_CAP_MB:g} MiB a unit"
    )
    return threshold, why
