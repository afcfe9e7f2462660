"""Ways to look at a step graph: code, Graphviz (dot/svg), JSON and a diff."""

from __future__ import annotations

import difflib
import json
from typing import Any

import pydot
import torch
import torch.fx as fx

from transpiler.errors import ConfigurationError

from .collectives import is_collective, is_wait
from .program import StepProgram

ROLE_COLORS = {
    "forward": "#dbeafe",
    "loss": "#fef3c7",
    "loss_grad": "#fde68a",
    "backward": "#e0e7ff",
    "communication": "#fecaca",
    "optimizer": "#dcfce7",
}


def target_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return ""


def to_dot(graph: fx.Graph, title: str) -> pydot.Dot:
    """A Graphviz picture: nodes coloured by role, collectives and waits drawn bold red."""
    dot = pydot.Dot(graph_type="digraph", rankdir="TB", label=title, fontsize="12")
    dot.set_node_defaults(shape="box", style="filled,rounded", fontname="Helvetica", fontsize="10")
    for node in graph.nodes:
        label = f"{node.name}\\n{target_name(node)}"
        shape = _describe(node.meta.get("val"))
        if shape:
            label += f"\\n{shape}"
        attrs = {"fillcolor": ROLE_COLORS.get(node.meta.get("role"), "#f3f4f6")}
        if is_collective(node) or is_wait(node):
            attrs.update(color="#dc2626", penwidth="2.5", fontcolor="#991b1b")
        if "grad_of" in node.meta:
            label += f"\\ngrad of {node.meta['grad_of']}"
        if "p2p" in node.meta:
            p2p = node.meta["p2p"]
            label += f"\\nexchange with rank {p2p['peer']} (level {p2p['level']}, {p2p['phase']})"
            attrs.update(color="#7c3aed", penwidth="2.5", fontcolor="#5b21b6")
        dot.add_node(pydot.Node(f'"{node.name}"', label=f'"{label}"', **attrs))
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            dot.add_edge(pydot.Edge(f'"{inp.name}"', f'"{node.name}"'))
    return dot


def to_svg(graph: fx.Graph, title: str) -> str:
    try:
        return to_dot(graph, title).create_svg().decode()
    except (FileNotFoundError, OSError) as exc:  # pydot raises these when Graphviz's dot is missing
        raise ConfigurationError(
            "rendering SVG needs Graphviz's 'dot' program (apt-get install graphviz, or brew install graphviz); "
            "use --format dot to get the source instead."
        ) from exc


def to_json(program: StepProgram, graph: fx.Graph) -> str:
    nodes = []
    for node in graph.nodes:
        entry = {
            "name": node.name,
            "op": node.op,
            "target": target_name(node),
            "role": node.meta.get("role"),
            "inputs": [i.name for i in node.all_input_nodes],
            "value": _describe(node.meta.get("val")),
        }
        if "grad_of" in node.meta:
            entry["grad_of"] = node.meta["grad_of"]
        if "collective" in node.meta:
            entry["collective"] = {
                k: list(v) if isinstance(v, tuple) else v for k, v in node.meta["collective"].items()
            }
        if "p2p" in node.meta:
            entry["p2p"] = dict(node.meta["p2p"])
        if "port" in node.meta:
            entry["port"] = {"kind": node.meta["port"].kind, "name": node.meta["port"].name}
        nodes.append(entry)
    doc = {
        "world_size": program.world_size,
        "rank": program.rank,
        "passes": [label for label, _ in program.history],
        "inputs": [vars(p) for p in program.inputs],
        "outputs": [vars(p) for p in program.outputs],
        "nodes": nodes,
    }
    return json.dumps(doc, indent=2)


def unified_diff(before: str, after: str, *, before_label: str = "traced", after_label: str = "rewritten") -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), before_label, after_label, n=2
        )
    )
