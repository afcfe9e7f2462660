"""What feeding a program and writing its outputs back reads every step, worked out once per program.

A program whose update runs per parameter has hundreds of ports (DiLoCo's inner step on the bench's narrow GPT:
601 inputs, 597 outputs), and the feed walked them all each step to sort them by kind. After
``reinplace-optimizer`` almost every output is the very input it was fed (596 of 597 there): the update wrote
into it, and writing it back changes nothing. :class:`ProgramPorts` holds the ports in order, the names of the
kinds the feed builds per step, and for each output the input it returns unchanged, so the feed and the write-back
do per step only what the step needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from transpiler.graph.ports import OUTER, PortKind
from transpiler.graph.program import StepProgram


@dataclass(frozen=True)
class ProgramPorts:
    """One program's ports: ``order`` (each input's kind and name, in order), ``scalars`` and ``params`` (the
    names of its scalar and parameter inputs), ``state`` (each input of the optimizer's state: its port name, its
    parameter and key in ``optimizer.state``), and per output, ``returned``: the index of the input of the same
    port that the program returns as it got it (updated in place), else None; ``held``: where its value belongs
    already when it is that input (None: a parameter's tensor; a parameter and key: that state tensor)."""

    order: tuple[tuple[PortKind, str], ...]
    kinds: frozenset[PortKind]
    scalars: tuple[str, ...]
    params: tuple[str, ...]
    state: tuple[tuple[str, torch.Tensor, str], ...]
    returned: tuple[int | None, ...]
    held: tuple[tuple[torch.Tensor, str] | None, ...]

    @classmethod
    def of(cls, program: StepProgram, params: dict[str, torch.Tensor]) -> ProgramPorts:
        """``program``'s ports, for the model's trainable parameters ``params`` by name."""
        inputs = [(port.kind, port.name) for port in program.inputs]
        placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
        index = {node: i for i, node in enumerate(placeholders)} if len(placeholders) == len(inputs) else {}
        values = program.graph.output_node().args[0]
        values = values if isinstance(values, (list, tuple)) and len(values) == len(program.outputs) else ()
        returned: list[int | None] = [None] * len(program.outputs)
        held: list[tuple[torch.Tensor, str] | None] = [None] * len(program.outputs)
        for i, (port, value) in enumerate(zip(program.outputs, values)):
            j = index.get(value) if isinstance(value, fx.Node) else None
            if j is None or inputs[j] != (port.kind, port.name):
                continue
            if port.kind == PortKind.PARAM:
                returned[i] = j
            elif port.kind == PortKind.STATE and not port.name.startswith(OUTER):
                returned[i], held[i] = j, _state_entry(port.name, params)
        return cls(
            order=tuple(inputs),
            kinds=frozenset(kind for kind, _ in inputs),
            scalars=tuple(name for kind, name in inputs if kind == PortKind.SCALAR),
            params=tuple(name for kind, name in inputs if kind == PortKind.PARAM),
            state=tuple(
                (name, *_state_entry(name, params))
                for kind, name in inputs
                if kind == PortKind.STATE and not name.startswith(OUTER)
            ),
            returned=tuple(returned),
            held=tuple(held),
        )


def _state_entry(port: str, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    """A state port ``<param>.<key>``: the parameter that keys ``optimizer.state``, and the key."""
    name, key = port.rsplit(".", 1)
    return params[name], key
