"""``diloco-outer-step``: DiLoCo's sync (Douillard et al., 2023), as a graph rewrite of the inner step.

Requires: a traced step whose optimizer updates each parameter locally (no gradient reduction before it), and
``program.outer_update``, the outer optimizer's update traced on its own (``transpiler/trace/outer.py``).
Guarantees: after the inner update ``θ_i`` of each trainable parameter, the pseudo-gradient
``Δ = θ_global - θ_i`` (``θ_global`` an ``extra`` input ``global.<param>``, first a copy of the broadcast
parameter, as LocalSGD's snapshot); the Δs sum all-reduced in dtype/size buckets (one bucketed all-reduce,
``reduce_in_buckets``), times ``1/world_size``; the outer update inlined on ``(θ_global, mean Δ)``, its state
and scalar ports prefixed ``outer/`` (the runtime feeds them from the outer optimizer); its result the new
``θ_global`` and, by default, the parameter every replica continues from. The inner optimizer's state is left as
the inner update wrote it. With ``fragments=P`` and ``fragment=f`` only fragment ``f``'s parameters sync
(Streaming DiLoCo's fragments, :func:`fragments_of`), and with ``fragment_update_alpha`` (α) the parameter
becomes ``α * θ_i + (1 - α) * θ_global'`` (Streaming DiLoCo's mixing; 0, the default, is plain DiLoCo).
Streaming (more than one fragment, a ``phase`` or an ``exchange_dtype`` other than the defaults) sends the fragment's
Δs as one float32 buffer in the wire format ``exchange_dtype`` (``pseudo_exchange.py``); ``phase=start`` issues the
exchange and outputs it unwaited as the extra state ``inflight.<f>``, ``phase=finish`` (a later step's program)
reads that, waits, and does the rest, and ``whole`` does both in one program.
With ``offload_global`` θ_global lives in host memory (``global.<param>`` on the CPU, rule ``host_copy_param``): each
sync copies it to the parameter's device after the inner update, where the Δ needs it (``foreach-update`` may
then hoist the copies just before the updates it fuses, still after the backward), and the new
θ_global back to the host as the output, so between syncs the device holds no copy of it (torchft's
``backup_device``). The copies are nodes (``offload`` in their meta) that the dumps show.
With ``topk > 0`` (SparseLoCo, Sarfi et al., 2025, as its authors' code computes it) each Δ is first added into
an error buffer that never leaves the rank (``error_feedback.<param>``, ``e = error_decay·e + outer_lr·Δ``,
``outer_lr`` the outer lr, as the authors' optimizer adds its lr·gradient), and only the top-k entries of each
tile of ``e`` (k scaled to the tile's size), quantised per tensor with ``quantization_bins``, are sent and taken
out of it: one all-gather, each entry averaged over the ranks that sent it (``sparse_pseudo_exchange.py``); the
mode gives the outer update as plain SGD at the same lr.
The outer update reads only the averaged Δ: every node it takes as a gradient is tagged
``meta["averaged_delta_of"]``, which the verifier ``check_outer_reads_averaged`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.edit import Cursor, ancestors, fake_mode, refresh_value
from transpiler.graph.options import option
from transpiler.graph.pipeline import Fact, Pass
from transpiler.graph.ports import ERROR_FEEDBACK, GLOBAL, IN_FLIGHT, OUTER, ExtraInit, Port, PortKind, is_input
from transpiler.graph.program import StepProgram

from . import pseudo_exchange, sparse_pseudo_exchange
from .bucketing import bucket_cap_option, caps_in_bytes, first_bucket_option, reduce_in_buckets, unflatten
from .gradient_flow import (
    add_input,
    add_outputs,
    add_state,
    before_output,
    output_values,
    participant_count,
    seed_end,
    set_output_values,
)
from .partitions import module_fragments
from .pseudo_exchange import EXCHANGES, carried_like

aten = torch.ops.aten
PHASES = ("whole", "start", "finish")
COMM = {"role": "communication"}


@dataclass(frozen=True)
class DiLoCoOuterStep(Pass):
    name = "diloco-outer-step"
    requires = frozenset({Fact.FUNCTIONAL, Fact.UNFLATTENED})  # it reads each parameter's new value
    invalidates = frozenset({Fact.UPDATED_LOCALLY})  # and replaces it with the outer step's
    summary = "DiLoCo sync: all-reduce pseudo-gradients θ_global - θ, outer optimizer on θ_global, write back"
    fragments: int = option(1, minimum=1, help="split the parameters into this many fragments (streaming)")
    fragment: int = option(0, minimum=0, help="the fragment this program syncs (0 .. fragments-1)")
    fragment_update_alpha: float = option(0.0, minimum=0, maximum=1, help="keep α·local + (1 − α)·global (streaming)")
    phase: str = option("whole", choices=PHASES, help="whole sync; or start the exchange, or finish it (a later step)")
    exchange_dtype: str = option(
        "float32", choices=EXCHANGES, help="wire format of the pseudo-gradients (summed in float32)"
    )
    offload_global: bool = option(False, help="keep θ_global in host memory, copied to the device at each sync")
    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()
    participants: bool = option(
        False, help="average over the step's input 'participants' (a torchft quorum's size), not the world size"
    )
    topk: int = option(0, minimum=0, help="SparseLoCo: send the top-k of each chunk × chunk tile of an error buffer")
    chunk_size: int = option(
        64, minimum=1, help="SparseLoCo: the most a tile's side takes (a divisor of the dimension)"
    )
    quantization_bins: int = option(0, minimum=0, help="SparseLoCo: quantisation bins per tensor (0: float32 values)")
    quantization_range: float = option(6.0, minimum=0, help="SparseLoCo: the quantiser's range, in standard deviations")
    error_decay: float = option(0.0, minimum=0, maximum=1, help="SparseLoCo: β of the error buffer e = β·e + lr·Δ")
    outer_lr: float = option(1.0, minimum=0, help="SparseLoCo: the lr that Δ enters the error buffer with")
    inline_exchange: bool = option(
        False,
        help="SparseLoCo: top-k and decoding as calls Inductor compiles (compile=True); off: one op each",
    )

    def for_inductor(self) -> DiLoCoOuterStep:
        """SparseLoCo's exchange inline, for Inductor to compile (plain DiLoCo sends no selection)."""
        return replace(self, inline_exchange=True) if self.topk else self

    def __post_init__(self) -> None:
        super().__post_init__()
        sparse_pseudo_exchange.check_options(self.quantization_bins, "SparseLoCo")
        if self.topk > self.chunk_size**2:
            raise ConfigurationError(
                f"topk={self.topk} of a {self.chunk_size}×{self.chunk_size} tile ({self.chunk_size**2} entries): give "
                "topk <= chunk_size² (the published run keeps 128 of 64×64)."
            )
        if self.topk and self.streaming:
            raise ConfigurationError(
                "a sparse exchange (topk > 0) sends the whole model at each sync: it does not combine with "
                "fragments, a phased exchange or exchange dtypes (Streaming DiLoCo's options)."
            )

    @property
    def streaming(self) -> bool:
        """Streaming DiLoCo's exchange: fragments, a phase or a wire format other than the defaults."""
        return self.fragments > 1 or self.phase != "whole" or self.exchange_dtype != "float32"

    def run(self, program: StepProgram) -> bool:
        if program.outer_update is None:
            raise ConfigurationError(
                "diloco-outer-step applies an outer optimizer, and this step was traced without one: use "
                "mode='diloco' (transpile(..., outer_optimizer=...)), which traces it."
            )
        if self.fragment >= self.fragments:
            raise ConfigurationError(f"fragment={self.fragment} of fragments={self.fragments}: count from 0.")
        if any(p.kind == "extra" and p.name.startswith((GLOBAL, IN_FLIGHT)) for p in program.inputs):
            return False
        values = output_values(program)
        where = {port.name: i for i, port in enumerate(program.outputs) if port.kind == "param"}
        parts = fragments_of(program, self.fragments)
        names = [name for name in where if parts[name] == self.fragment]
        locals_ = {name: values[where[name]] for name in names}
        globals_ = {name: self._global(program, name, locals_[name]) for name in names}
        kept: dict[str, fx.Node] = {}  # SparseLoCo's error buffers, as the sync leaves them
        if self.topk:  # the exchange averages each entry over the ranks that sent it
            means, kept = self._sparse_means(program, globals_, locals_)
        else:
            if not self.streaming:
                sums = self._bucketed_sums(program, globals_, locals_)
            else:
                sums = self._fragment_sums(program, globals_, locals_)
                if sums is None:  # the exchange is in flight: a later step finishes it
                    return True
            inverse = self._inverse_count(program)
            means = {
                name: Cursor(program.graph, total).emit(
                    aten.mul.Tensor, (total, inverse), role="communication", averaged_delta_of=name
                )
                for name, total in sums.items()
            }
        new_global, new_state = self._inline_outer(program, globals_, means)
        cursor = before_output(program)
        extra_values = list(kept.values())
        extra_ports = [Port("extra", f"{ERROR_FEEDBACK}{n}") for n in kept]
        for name in names:
            theta = new_global[name]
            if (
                self.fragment_update_alpha
            ):  # α·θ_local + (1 - α)·θ_global, θ_local as it is now (τ inner steps after the start)
                kept = cursor.emit(aten.mul.Tensor, (values[where[name]], self.fragment_update_alpha), role="optimizer")
                taken = cursor.emit(aten.mul.Tensor, (theta, 1.0 - self.fragment_update_alpha), role="optimizer")
                theta = cursor.emit(aten.add.Tensor, (kept, taken), role="optimizer")
            values[where[name]] = theta
            if self.offload_global:  # back to the host, which keeps it until the next sync
                host = {"device": torch.device("cpu")}
                kept_global = cursor.emit(aten._to_copy.default, (new_global[name],), host, **COMM, offload="to host")
            else:
                kept_global = cursor.emit(aten.clone.default, (new_global[name],), role="optimizer", outer=True)
            extra_values.append(kept_global)
            extra_ports.append(Port("extra", f"{GLOBAL}{name}"))
        set_output_values(program, values)
        add_outputs(program, extra_values + list(new_state.values()), extra_ports + list(new_state))
        return True

    def _inverse_count(self, program: StepProgram) -> float | fx.Node:
        """What the Δ sums are multiplied by: 1/world_size, or with ``participants`` the reciprocal of the input
        ``participants`` (the same float32 for the same count)."""
        if not self.participants:
            return 1.0 / program.world_size
        count = participant_count(program)
        return Cursor(program.graph, count).emit(aten.reciprocal.default, (count,), **COMM)

    def _global(self, program: StepProgram, name: str, local: fx.Node) -> fx.Node:
        """θ_global of parameter ``name`` as the sync reads it: the ``extra`` input, or with ``offload_global`` the
        input in host memory copied to the device right after the inner update ``local``."""
        if not self.offload_global:
            return add_state(program, f"{GLOBAL}{name}", local, ExtraInit.copy_of(name))
        val = local.meta["val"]
        host = add_state(program, f"{GLOBAL}{name}", _fake(program, val, "cpu"), ExtraInit.host_copy_of(name))
        to_device = {"device": val.device, "non_blocking": True}
        return Cursor(program.graph, local).emit(aten._to_copy.default, (host,), to_device, **COMM, offload="to device")

    def _bucketed_sums(
        self, program: StepProgram, globals_: dict[str, fx.Node], locals_: dict[str, fx.Node]
    ) -> dict[str, fx.Node]:
        """DiLoCo: each Δ sum all-reduced in dtype/size buckets, waited in this program (each Δ right after its
        parameter's update, and after θ_global's copy to the device under ``offload_global``)."""
        items = [
            (
                name,
                Cursor(program.graph, globals_[name] if self.offload_global else node).emit(
                    aten.sub.Tensor, (globals_[name], node), role="communication"
                ),
            )
            for name, node in locals_.items()
        ]
        caps = caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb)
        reduced = reduce_in_buckets(program, items, *caps, tag="pseudo-gradients")
        return dict(zip(locals_, reduced))

    def _sparse_means(
        self, program: StepProgram, globals_: dict[str, fx.Node], locals_: dict[str, fx.Node]
    ) -> tuple[dict[str, fx.Node], dict[str, fx.Node]]:
        """SparseLoCo: each Δ added into its error buffer (``error_feedback.<param>``, ``e = β·e + lr·Δ``, extra
        state that never leaves the rank), the top-k of each tile sent (``sparse_pseudo_exchange``). Returns the
        means and the buffers with what was sent taken out, which the sync outputs."""
        cursor = before_output(program)
        bad = [n for n, node in locals_.items() if node.meta["val"].dtype != torch.float32]
        if bad:
            raise ConfigurationError(f"SparseLoCo's error buffers are float32; parameters {bad[:3]} are not.")
        names = list(locals_)  # each op over every parameter at once (one _foreach_* op: the same bits)
        pairs = ([globals_[n] for n in names], [locals_[n] for n in names])
        deltas = cursor.emit_each(aten._foreach_sub.List, pairs, **COMM)
        errors = [add_state(program, f"{ERROR_FEEDBACK}{n}", locals_[n], ExtraInit.zeros_like(n)) for n in names]
        if self.error_decay != 1.0:  # as the authors' optimizer: no multiply by 1
            errors = cursor.emit_each(aten._foreach_mul.Scalar, (errors, self.error_decay), **COMM)
        added = cursor.emit_each(aten._foreach_add.List, (errors, deltas), {"alpha": self.outer_lr}, **COMM)
        buffers = dict(zip(names, added))
        sparsity = sparse_pseudo_exchange.Sparsity(
            self.chunk_size, self.topk, True, self.quantization_bins, self.quantization_range
        )
        means, kept = sparse_pseudo_exchange.exchange(program, cursor, buffers, sparsity, inline=self.inline_exchange)
        for name, mean in means.items():
            mean.meta["averaged_delta_of"] = name
        return means, kept

    def _fragment_sums(
        self, program: StepProgram, globals_: dict[str, fx.Node], locals_: dict[str, fx.Node]
    ) -> dict[str, fx.Node] | None:
        """Streaming: the fragment's Δs in one float32 buffer, one exchange (``pseudo_exchange``). ``start``
        issues it and carries it out unwaited as ``inflight.<fragment>``; ``finish`` reads that and returns the
        sums; ``whole`` does both here."""
        bad = [n for n, node in locals_.items() if node.meta["val"].dtype != torch.float32]
        if bad:
            raise ConfigurationError(
                f"streaming DiLoCo exchanges float32 pseudo-gradients; parameters {bad[:3]} are not float32."
            )
        length = sum(node.meta["val"].numel() for node in locals_.values())
        wire_length, wire_dtype = carried_like(length, program.world_size, self.exchange_dtype)
        carried_name = f"{IN_FLIGHT}{self.fragment}"
        info = {
            "kind": "pseudo-gradients",
            "fragment": self.fragment,
            "exchange": self.exchange_dtype,
            "pseudo-gradients": tuple(locals_),
            "bytes": wire_length * wire_dtype.itemsize,
        }
        init = ExtraInit.zeros([wire_length], wire_dtype)  # a resumed run's: never read
        if self.phase == "finish":
            carried = add_state(program, carried_name, _fake(program, torch.empty(wire_length, dtype=wire_dtype)), init)
        else:
            cursor = before_output(program)
            deltas = [cursor.emit(aten.sub.Tensor, (globals_[n], node), **COMM) for n, node in locals_.items()]
            pieces = [cursor.emit(aten.reshape.default, (delta, [-1]), **COMM) for delta in deltas]
            flat = cursor.emit(aten.cat.default, (pieces,), **COMM)
            carried = pseudo_exchange.start(program, cursor, flat, self.exchange_dtype, info)
            if self.phase == "start":
                program.extra_init[carried_name] = init
                add_outputs(program, [carried], [Port("extra", carried_name)])
                return None
        info = info | {"finishes": True}  # a new dict: the one start() gave its collective stays as it is
        # an exchange started by an earlier step goes on where this step's forward ends (its all-gather then runs
        # behind the backward); one started here has nothing left to hide behind
        early = Cursor(program.graph, seed_end(program)) if self.phase == "finish" else before_output(program)
        reduced = pseudo_exchange.reduce(program, early, carried, length, self.exchange_dtype, info)
        cursor = before_output(program)
        total = pseudo_exchange.finish(program, cursor, reduced, length, self.exchange_dtype)
        views = unflatten(cursor, total, list(locals_.values()), COMM)
        return {name: views[node] for name, node in locals_.items()}

    @staticmethod
    def _inline_outer(
        program: StepProgram, globals_: dict[str, fx.Node], means: dict[str, fx.Node]
    ) -> tuple[dict[str, fx.Node], dict[Port, fx.Node]]:
        """Copy the outer update's nodes before the output, for the parameters in ``globals_`` only; its state
        and scalars become inputs ``outer/...``. Returns the new θ_global per parameter and the new state by
        output port."""
        outer = program.outer_update
        graph = program.graph
        placeholders = [n for n in outer.graph_module.graph.nodes if n.op == "placeholder"]
        results = list(outer.graph_module.graph.output_node().args[0])
        wanted = {i for i, port in enumerate(outer.outputs) if _param_of(port) in globals_}
        needed = ancestors([results[i] for i in wanted])
        env: dict[fx.Node, fx.Node] = {}
        for node, port in zip(placeholders, outer.inputs):
            if node not in needed:
                continue
            if port.kind == "param":
                env[node] = globals_[port.name]
            elif port.kind == "grad":
                env[node] = means[port.name]
            else:
                env[node] = add_input(program, Port(port.kind, OUTER + port.name), _in_mode(program, node))
        body = [n for n in outer.graph_module.graph.nodes if n.op == "call_function" and n in needed]
        cursor = before_output(program)
        cursor.copy(body, env)
        for node in body:
            copied = env[node]
            for attr in [a for a in copied.all_input_nodes if a.op == "get_attr"]:
                raise ConfigurationError(f"the outer update reads a constant '{attr.target}', which it cannot carry")
            if isinstance(node.meta.get("val"), torch.Tensor):
                refresh_value(graph, copied)  # a fake value of this program's fake mode, not the outer trace's
        new_global, new_state = {}, {}
        for i in sorted(wanted):
            port, value = outer.outputs[i], env[results[i]]
            if port.kind == "param":
                new_global[port.name] = value
            else:
                new_state[Port("state", OUTER + port.name)] = value
        return new_global, new_state


def fragments_of(program: StepProgram, fragments: int) -> dict[str, int]:
    """The fragment of each trainable parameter: the model's parameters cut into ``fragments`` runs of whole
    modules, balanced by size (``partitions.module_fragments``), the same on every rank."""
    sizes = [(n.meta["port"].name, n.meta["val"].numel()) for n in program.graph.nodes if is_input(n, PortKind.PARAM)]
    return {name: 0 for name, _ in sizes} if fragments == 1 else module_fragments(sizes, fragments)


def _fake(program: StepProgram, like: torch.Tensor, device: str | None = None) -> torch.Tensor:
    """A fake tensor of the program's fake mode shaped as ``like``, on its device or on ``device``."""
    with fake_mode(program.graph):
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device or like.device)


def _in_mode(program: StepProgram, node: fx.Node) -> torch.Tensor | None:
    """The outer trace's fake value of ``node`` made again in the program's fake mode (None for the generic
    path's lr, a float the runtime feeds)."""
    val = node.meta.get("val")
    return _fake(program, val) if isinstance(val, torch.Tensor) else None


def _param_of(port: Port) -> str:
    """The parameter an outer output belongs to (``<param>`` or ``<param>.<key>``)."""
    return port.name if port.kind == "param" else port.name.rsplit(".", 1)[0]
