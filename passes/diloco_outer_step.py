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
(Streaming DiLoCo's fragments, :func:`fragment_of`), and with ``alpha`` the parameter becomes
``alpha * θ_i + (1 - alpha) * θ_global'`` (Streaming DiLoCo's mixing; 0, the default, is plain DiLoCo).
The outer update reads only the averaged Δ: every node it takes as a gradient is tagged
``meta["averaged_delta_of"]``, which the verifier ``check_outer_reads_averaged`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError
from transpiler.graph.edit import Cursor, refresh_value
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import Port, StepProgram

from .bucketing import bucket_cap_option, caps_in_bytes, first_bucket_option, reduce_in_buckets
from .gradient_flow import add_input, add_state, before_output
from .partitions import module_fragments

aten = torch.ops.aten
OUTER = "outer/"  # the prefix of the outer optimizer's state and scalar ports
GLOBAL = "global."  # the prefix of θ_global's extra state


@dataclass(frozen=True)
class DiLoCoOuterStep(Pass):
    name = "diloco-outer-step"
    summary = "DiLoCo sync: all-reduce pseudo-gradients θ_global - θ, outer optimizer on θ_global, write back"
    fragments: int = option(1, minimum=1, help="split the parameters into this many fragments (streaming)")
    fragment: int = option(0, minimum=0, help="the fragment this program syncs (0 .. fragments-1)")
    alpha: float = option(0.0, minimum=0, maximum=1, help="keep alpha * local + (1 - alpha) * global (streaming)")
    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()

    def run(self, program: StepProgram) -> bool:
        if program.outer_update is None:
            raise ConfigurationError(
                "diloco-outer-step applies an outer optimizer, and this step was traced without one: use "
                "mode='diloco' (transpile(..., outer_optimizer=...)), which traces it."
            )
        if self.fragment >= self.fragments:
            raise ConfigurationError(f"fragment={self.fragment} of fragments={self.fragments}: count from 0.")
        if any(p.kind == "extra" and p.name.startswith(GLOBAL) for p in program.inputs):
            return False
        output = program.graph.output_node()
        values = list(output.args[0])
        ports = list(program.outputs)
        where = {port.name: i for i, port in enumerate(ports) if port.kind == "param"}
        names = [name for name in where if fragment_of(program, name, self.fragments) == self.fragment]
        scale = 1.0 / program.world_size
        globals_, items = {}, []
        for name in names:
            node = values[where[name]]
            globals_[name] = add_state(program, f"{GLOBAL}{name}", node, ("copy_param", name))
            delta = Cursor(program.graph, node).emit(
                aten.sub.Tensor, (globals_[name], node), role="communication", pseudo_gradient_of=name
            )
            items.append((name, delta))
        reduced = reduce_in_buckets(
            program, items, *caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb), tag="pseudo-gradients"
        )
        means = {}
        for name, total in zip(names, reduced):
            means[name] = Cursor(program.graph, total).emit(
                aten.mul.Tensor, (total, scale), role="communication", averaged_delta_of=name
            )
        new_global, new_state = self._inline_outer(program, globals_, means)
        extra_values, extra_ports = [], []
        cursor = before_output(program)
        for name in names:
            theta = new_global[name]
            if self.alpha:
                local = values[where[name]]
                theta = cursor.emit(aten.lerp.Scalar, (theta, local, self.alpha), role="optimizer", outer=True)
            values[where[name]] = theta
            extra_values.append(cursor.emit(aten.clone.default, (new_global[name],), role="optimizer", outer=True))
            extra_ports.append(Port("extra", f"{GLOBAL}{name}"))
        for port, value in new_state.items():
            extra_values.append(value)
            extra_ports.append(port)
        output.args = (tuple(values + extra_values),)
        program.outputs = ports + extra_ports
        return True

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
        needed = _ancestors([results[i] for i in wanted])
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


def fragment_of(program: StepProgram, name: str, fragments: int) -> int:
    """The fragment of a trainable parameter: the model's parameters cut into ``fragments`` runs of whole
    modules, balanced by size (``partitions.module_fragments``), the same on every rank."""
    if fragments == 1:
        return 0
    sizes = [
        (n.meta["port"].name, n.meta["val"].numel())
        for n in program.graph.nodes
        if n.op == "placeholder" and n.meta.get("port", Port("", "")).kind == "param"
    ]
    return module_fragments(sizes, fragments)[name]


def _in_mode(program: StepProgram, node: fx.Node) -> torch.Tensor | None:
    """The outer trace's fake value of ``node`` made again in the program's fake mode (None for the generic
    path's lr, a float the runtime feeds)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    mode = next(n.meta["val"].fake_mode for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _param_of(port: Port) -> str:
    """The parameter an outer output belongs to (``<param>`` or ``<param>.<key>``)."""
    return port.name if port.kind == "param" else port.name.rsplit(".", 1)[0]


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen
