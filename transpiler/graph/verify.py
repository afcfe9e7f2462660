"""Invariants checked between passes, and across ranks (the README lists them after its table of passes).

Each verifier takes the program and whether the pipeline has finished, and
raises :class:`VerificationError` with a message that names the node at fault.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch.fx as fx

from transpiler.errors import VerificationError

from .bucket_layout import WHOLE_SHAPE, check_bucket_views
from .collectives import CommOp, collective_sequence, communication_plan, is_collective, is_wait
from .ports import GLOBAL, IN_FLIGHT, OUTER, PRIVATE, PortKind
from .program import ROLES, StepProgram
from .quorum_ops import AWAIT_VOTE
from .views import written_input


def check_roles(program: StepProgram, final: bool) -> None:
    """Every op node says which part of the step it belongs to."""
    for node in program.graph.nodes:
        if node.op == "call_function" and node.meta.get("role") not in ROLES:
            raise VerificationError(f"node '{node.name}' has no role (meta['role'] = {node.meta.get('role')!r}).")


def check_collectives_waited(program: StepProgram, final: bool) -> None:
    """Each collective is waited exactly once, and only its wait reads it."""
    carried = _carried_out(program)
    for node in program.graph.nodes:
        if not is_collective(node) or node in carried:
            continue
        waits = [u for u in node.users if is_wait(u)]
        others = [u.name for u in node.users if not is_wait(u)]
        if len(waits) != 1 or others:
            raise VerificationError(
                f"collective '{node.name}' must be read by exactly one wait_tensor and nothing else; "
                f"it has {len(waits)} waits and other users {others}."
            )


def _carried_out(program: StepProgram) -> set[fx.Node]:
    """Collectives carried unwaited to a later program: output as an ``extra`` port named ``inflight.*`` and read
    by nothing else."""
    output = program.graph.output_node()
    found = set()
    for port, value in zip(program.outputs, output.args[0]):
        if port.kind == "extra" and port.name.startswith(IN_FLIGHT) and is_collective(value):
            if list(value.users) != [output]:
                raise VerificationError(f"collective '{value.name}' is carried to a later step and read here too.")
            found.add(value)
    return found


def check_gradient_reductions(program: StepProgram, final: bool) -> None:
    """Along every path from a gradient to the optimizer, count the all-reduces.

    Between passes a gradient may be reduced at most once; once the pipeline
    has finished with a reducing pass, exactly once on every path. One sweep
    in graph order gives, for each communication node, the set of reduction
    counts over all paths reaching it; only on failure is the guilty gradient
    traced path by path, for the message.
    """
    counts: dict[fx.Node, set[int]] = {}
    for node in program.graph.nodes:
        if "grad_of" in node.meta:
            counts[node] = {0}
        elif node.meta.get("role") == "communication":
            reaching = [counts[i] for i in node.all_input_nodes if i in counts]
            if reaching:
                step = 1 if _is_all_reduce(node) else 0
                counts[node] = {c + step for s in reaching for c in s}
    bad = any(
        max(c) > 1 or (final and c != {1})
        for node, c in counts.items()
        if any(u.meta.get("role") == "optimizer" for u in node.users)
    )
    if final and not bad:  # every gradient must reach the optimizer: one sweep backwards
        reaches: set[fx.Node] = set()
        for node in reversed(program.graph.nodes):
            if node in counts and any(u.meta.get("role") == "optimizer" or u in reaches for u in node.users):
                reaches.add(node)
        bad = any(g not in reaches for g in counts if "grad_of" in g.meta)
    if not bad:
        return
    for grad in (n for n in program.graph.nodes if "grad_of" in n.meta):
        found = _reductions_to_optimizer(grad)
        name = grad.meta["grad_of"]
        if any(c > 1 for c in found):
            raise VerificationError(f"gradient of '{name}' is all-reduced {max(found)} times before the optimizer.")
        if final and found != {1}:
            missing = "never reaches the optimizer" if not found else "reaches the optimizer un-reduced"
            raise VerificationError(f"gradient of '{name}' {missing}; it must be all-reduced exactly once.")


def _is_all_reduce(node: fx.Node) -> bool:
    """A collective that reduces gradient values (an all-reduce, or the all-gathers of a sparse or gathered
    reduction); AdaSum's all-reduces of dot products and norms, and flags, are not."""
    return is_collective(node) and "grads" in node.meta.get("collective", {})


def _reductions_to_optimizer(grad: fx.Node) -> set[int]:
    """Reduction counts on the paths from ``grad`` through communication nodes into the optimizer."""
    seen: dict[fx.Node, set[int]] = {grad: {0}}
    found: set[int] = set()
    queue = deque([grad])
    while queue:
        node = queue.popleft()
        for user in node.users:
            role = user.meta.get("role")
            if role == "optimizer":
                found |= seen[node]
                continue
            if role != "communication":
                continue
            new = {c + _is_all_reduce(user) for c in seen[node]} - seen.get(user, set())
            if new:
                seen.setdefault(user, set()).update(new)
                queue.append(user)
    return found


def check_outer_reads_averaged(program: StepProgram, final: bool) -> None:
    """An outer update (nodes tagged ``meta["outer"]``, DiLoCo's) reads only itself, its own inputs (θ_global, its
    state and scalars) and averaged pseudo-gradients (``meta["averaged_delta_of"]``), each of which is computed
    after waiting for a collective: never a rank's own Δ, a gradient or the local weights."""
    if not any(node.meta.get("outer") for node in program.graph.nodes):
        return
    waited: set[fx.Node] = set()  # the nodes a collective's wait precedes, in one pass in graph order
    for node in program.graph.nodes:
        if is_wait(node) or any(i in waited for i in node.all_input_nodes):
            waited.add(node)
        if not node.meta.get("outer"):
            continue
        for source in node.all_input_nodes:
            if source.meta.get("outer") or source.op in ("placeholder", "call_function") and _outer_input(source):
                continue
            if "averaged_delta_of" not in source.meta:
                raise VerificationError(
                    f"outer update node '{node.name}' reads '{source.name}', which is not an averaged "
                    "pseudo-gradient, θ_global or the outer optimizer's own state."
                )
            if source not in waited:
                raise VerificationError(
                    f"'{source.name}' is tagged as the averaged pseudo-gradient of "
                    f"'{source.meta['averaged_delta_of']}', but no collective's wait precedes it."
                )


def _outer_input(node: fx.Node) -> bool:
    """θ_global, the outer optimizer's state or scalars: an input, or θ_global's copy from host memory to the
    device (``offload``)."""
    if node.meta.get("offload") == "to device":
        node = node.args[0]
    port = node.meta.get("port")
    return port is not None and (port.kind == PortKind.EXTRA and port.name.startswith(GLOBAL) or OUTER in port.name)


def check_private_state_stays(program: StepProgram, final: bool) -> None:
    """State that must never leave its rank (``ports.PRIVATE``: SparseLoCo's error buffers, DeMo's momenta)
    reaches a collective only through a node tagged ``meta["sent"]``, the message a compressor made of it. One
    pass in graph order: a node carries the private input it computes from, unless it is such a message."""
    carried: dict[fx.Node, str] = {}
    for node in program.graph.nodes:
        if _is_private(node):
            carried[node] = node.meta["port"].name
            continue
        source = next((carried[n] for n in node.all_input_nodes if n in carried), None)
        if source is None or node.meta.get("sent"):
            continue
        if is_collective(node):
            raise VerificationError(
                f"collective '{node.name}' sends '{source}' (or what is computed from it) without going through "
                "the compressor's message: that state never leaves its rank."
            )
        carried[node] = source


def _is_private(node: fx.Node) -> bool:
    port = node.meta.get("port")
    return node.op == "placeholder" and port is not None and port.name.startswith(PRIVATE)


def check_fragments(programs: dict[str, StepProgram], variants: list[str], sync_every: int) -> None:
    """DiLoCo's fragments: the parameters the programs start sending Δ for (``meta["collective"]["pseudo-gradients"]``)
    cover every trainable parameter once over all fragments, and in ``variants`` (the schedule's first steps,
    from step 1) every sending program runs once in every ``sync_every`` steps after its first."""
    sent: dict[str, list[str]] = {}
    for variant, program in programs.items():
        for node in program.graph.nodes:
            info = node.meta.get("collective", {})
            names = info.get("pseudo-gradients")
            if names and not info.get("finishes"):  # the all-gather that finishes a low-precision exchange
                sent.setdefault(variant, []).extend(names)
    if not sent:
        return
    any_program = next(iter(programs.values()))
    params = [p.name for p in any_program.inputs if p.kind == "param"]
    owners: dict[str, list[str]] = {}
    for variant, names in sent.items():
        for name in dict.fromkeys(names):
            owners.setdefault(name, []).append(variant)
    wrong = {n: owners.get(n, []) for n in params if len(owners.get(n, [])) != 1}
    if wrong:
        raise VerificationError(
            "every parameter must sync in exactly one fragment; "
            + ", ".join(f"'{n}' in {v or 'none'}" for n, v in list(wrong.items())[:4])
        )
    for variant in sent:
        steps = [t for t, v in enumerate(variants, start=1) if v == variant]
        if not steps or any(b - a != sync_every for a, b in zip(steps, steps[1:])):
            raise VerificationError(
                f"fragment program '{variant}' runs at steps {steps[:6]}, not once every {sync_every} steps."
            )


def check_writes_wait_for_the_vote(program: StepProgram, final: bool) -> None:
    """A step a torchft quorum votes on (it reads the participant count) writes into its inputs only after its
    ``await_vote``: a step that does not commit must leave every input as it was (``overlap-quorum``)."""
    if not final or not any(port.kind == PortKind.QUORUM for port in program.inputs):
        return
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is AWAIT_VOTE:
            return
        written = written_input(node)
        if written is not None:
            raise VerificationError(
                f"node '{node.name}' writes into input '{written.name}' before the quorum's vote is counted, so a "
                "step that does not commit would change it. Under a quorum the pass that wrote it must leave the "
                "value as an output (see Strategy.under_quorum), or overlap-quorum must hold the write back."
            )


DEFAULT_VERIFIERS = [
    check_roles,
    check_collectives_waited,
    check_gradient_reductions,
    check_bucket_views,
    check_outer_reads_averaged,
    check_private_state_stays,
    check_writes_wait_for_the_vote,
]


def check_cross_rank(programs: list[StepProgram]) -> None:
    """All ranks of one world size issue the same collectives in the same order."""
    if not programs:
        return
    reference = collective_sequence(programs[0].graph)
    for program in programs[1:]:
        sequence = collective_sequence(program.graph)
        for i, (a, b) in enumerate(zip(reference, sequence)):
            if a != b:
                raise VerificationError(
                    f"rank {program.rank} issues collective #{i} as {b}, but rank {programs[0].rank} issues {a}: "
                    "the ranks would deadlock or reduce mismatched data."
                )
        if len(reference) != len(sequence):
            raise VerificationError(
                f"rank {program.rank} issues {len(sequence)} collectives, "
                f"rank {programs[0].rank} issues {len(reference)}."
            )


def check_shards(programs: list[StepProgram]) -> None:
    """Under a sharded optimizer, every element of every parameter is updated by exactly one rank of each shard
    group (the world, or each replica under ZeRO inside DiLoCo's replicas, ``program.shard_axis``): the ranks'
    ``[lo, hi)`` of each parameter tile ``[0, numel)`` in rank order, with no gap and no overlap."""
    if not programs or not any(p.shards for p in programs):
        return
    first = programs[0]
    sizes = {  # a parameter held as a slice (ZeRO-3) records its whole shape
        n.meta["port"].name: math.prod(n.meta.get(WHOLE_SHAPE, n.meta["val"].shape))
        for n in first.graph.nodes
        if n.op == "placeholder" and n.meta.get("port") is not None and n.meta["port"].kind == "param"
    }
    for bucket in first.param_buckets:  # ZeRO-3's parameters, also those a flat shard holds (no input of their own)
        sizes.update((name, math.prod(shape)) for name, shape in zip(bucket.names, bucket.shapes))
    check_tiling([Held(p.rank, *shard_place(p), p.shards) for p in programs], sizes)


@dataclass(frozen=True)
class Held:
    """The slices one rank updates: ``shards`` (parameter -> flat ``[lo, hi)``), at ``place`` in ``group``."""

    rank: int
    group: str
    place: int
    shards: Mapping[str, tuple[int, int]]


def shard_place(program: StepProgram) -> tuple[str, int]:
    """The shard group whose ranks tile every parameter (``program.shard_axis``) and the rank's place in it."""
    axis = program.axes.get(program.shard_axis)
    return ("world", program.rank) if axis is None else (axis.group_name, axis.rank)


def check_tiling(held: list[Held], sizes: Mapping[str, int]) -> None:
    """Each shard group's ranks, in their order within it, tile every parameter of ``sizes`` (name -> numel) they
    hold slices of; the static check and the startup handshake both run it."""
    groups: dict[str, list[Held]] = {}
    for h in held:
        groups.setdefault(h.group, []).append(h)
    for members in groups.values():
        members.sort(key=lambda h: h.place)
        for name in sorted(set().union(*(h.shards for h in members))):
            end = 0
            for h in members:
                lo, hi = h.shards.get(name, (end, end))
                if lo != end and hi > lo:
                    raise VerificationError(
                        f"parameter '{name}': rank {h.rank} updates elements [{lo}, {hi}), but the ranks before "
                        f"it end at {end}: elements would be updated twice or never."
                    )
                end = max(end, hi)
            if end != sizes.get(name, end):
                raise VerificationError(f"parameter '{name}': the ranks update {end} of its {sizes[name]} elements.")


def check_output_shapes(program: StepProgram) -> None:
    """After the pipeline, every parameter and state output has its input's shape: the runtime writes it back
    there (a sharded update whose slices were never gathered, ``shard-optimizer`` without ``gather-params``,
    would not)."""
    inputs = {n.meta.get("port"): n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    for port, value in zip(program.outputs, program.graph.output_node().args[0]):
        before, after = inputs.get(port), value.meta.get("val") if isinstance(value, fx.Node) else None
        if port.kind in ("param", "state") and before is not None and after is not None:
            if before.shape != after.shape:
                raise VerificationError(
                    f"{port.kind} '{port.name}' goes in as {list(before.shape)} and comes out as "
                    f"{list(after.shape)}; a sharded update needs gather-params after shard-optimizer."
                )


def check_communication(
    programs: list[StepProgram], members: dict[str, tuple[int, ...]], outside: Collection[str] = ()
) -> None:
    """Statically: simulate every rank's communication in order (see :func:`simulate_communication`), leaving out
    the collectives of the groups named in ``outside``."""
    simulate_communication({p.rank: communication_plan(p.graph, outside) for p in programs}, members)


def simulate_communication(plans: dict[int, list[CommOp]], members: dict[str, tuple[int, ...]]) -> None:
    """Run the ranks' communication plans against each other; raise if they would mismatch or deadlock.

    An exchange of rank r with peer p completes when p's next operation is an
    exchange with r whose send size is r's receive size and vice versa (same
    dtype); a collective completes when every member of its group has the same
    collective (op, shape, dtype) next. If no rank can move while some still
    have operations left, the ranks would deadlock, and the error says where.
    The same simulation runs on programs built in one process and on the plans
    the ranks exchange at startup.
    """
    heads = dict.fromkeys(plans, 0)

    def head(rank: int) -> CommOp | None:
        ops = plans.get(rank)
        return ops[heads[rank]] if ops is not None and heads[rank] < len(ops) else None

    def describe(rank: int) -> str:
        op = head(rank)
        return f"rank {rank}: " + ("done" if op is None else str(op))

    while any(head(r) is not None for r in plans):
        moved = False
        for rank in plans:
            op = head(rank)
            if op is None:
                continue
            if op.collective is None:
                other = head(op.peer)
                if other is None or other.collective is not None or other.peer != rank:
                    continue
                if op.send != other.recv or other.send != op.recv or op.dtype != other.dtype:
                    raise VerificationError(f"mismatched exchange: {describe(rank)}; {describe(op.peer)}.")
                heads[rank] += 1
                heads[op.peer] += 1
                moved = True
                continue
            group = members.get(op.collective.group)
            if group is None:
                raise VerificationError(f"rank {rank} uses unknown process group '{op.collective.group}'.")
            present = [r for r in group if r in plans]
            if all(head(r) is not None and head(r).collective == op.collective for r in present):
                for r in present:
                    heads[r] += 1
                moved = True
        if not moved:
            stuck = "; ".join(describe(r) for r in sorted(plans) if head(r) is not None)
            raise VerificationError(f"the ranks' communication would deadlock or mismatch: {stuck}.")
