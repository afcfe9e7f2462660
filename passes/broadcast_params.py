"""``broadcast-params``: a startup program that broadcasts rank 0's model.

Requires: nothing but the step's input ports.
Guarantees: ``program.startup`` is a graph that takes every parameter
(trainable and frozen) and buffer, broadcasts each from rank 0 and returns the
results, which the runtime writes into the model once before the first step
(Paddle's startup-program broadcast; DDP does the same at construction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from transpiler.graph.collectives import C10D, WAIT
from transpiler.graph.edit import emit
from transpiler.graph.options import option
from transpiler.graph.pipeline import Pass
from transpiler.graph.program import StepProgram

STARTUP_KINDS = ("param", "frozen", "buffer")


@dataclass(frozen=True)
class BroadcastParams(Pass):
    name = "broadcast-params"
    summary = "startup program: broadcast parameters and buffers from rank 0"
    src: int = option(0, minimum=0, help="the rank whose values every rank starts from")

    def run(self, program: StepProgram) -> bool:
        if program.startup is not None:
            return False
        graph = fx.Graph()
        sent, ports = [], []
        step_inputs = {n.meta["port"]: n for n in program.graph.nodes if n.op == "placeholder"}
        for port, source in step_inputs.items():
            if port.kind not in STARTUP_KINDS:
                continue
            ph = graph.placeholder(source.name)
            ph.meta.update(val=source.meta.get("val"), port=port)
            ports.append(port)
        for ph in list(graph.nodes):  # issue every broadcast first, then wait for them all
            info = {"kind": "broadcast", "tensors": (ph.meta["port"].name,)}
            args = (ph, self.src, program.group_name)
            sent.append(emit(graph, C10D.broadcast.default, args, role="communication", collective=info))
        graph.output(tuple(emit(graph, WAIT, (s,), role="communication") for s in sent))
        program.startup = fx.GraphModule(program.graph_module, graph)
        program.startup_ports = ports
        return True
