"""Pipeline time against graph size: deep narrow MLPs traced with SGD+momentum.

Reports, for each size, the traced graph's node count, tracing time, and the
time of each fused_allreduce pass (including the verifiers that run after it).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from transpiler.graph.pipeline import Pipeline
from transpiler.graph.verify import DEFAULT_VERIFIERS
from transpiler.strategies.modes import build_passes
from transpiler.trace.tracer import trace_step

LAYERS = (45, 225, 450, 1100, 2250)  # about 1k, 5k, 10k, 25k and 50k nodes


def measure(layers: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = time.perf_counter()
    traced = trace_step(model, opt, nn.MSELoss(), (torch.randn(4, 8), torch.randn(4, 8)))[0].program
    trace_s = time.perf_counter() - start
    program = traced.clone()
    program.world_size, program.group_name = 2, "world"
    start = time.perf_counter()
    records = Pipeline(build_passes("fused_allreduce", {}), list(DEFAULT_VERIFIERS)).run(program)
    return {
        "layers": layers,
        "nodes": len(traced.graph.nodes),
        "nodes_after": len(program.graph.nodes),
        "trace_s": trace_s,
        "pipeline_s": time.perf_counter() - start,
        "passes": {r.name: r.seconds for r in records},
    }


def run(progress=print) -> list[dict]:
    rows = []
    for layers in LAYERS:
        rows.append(measure(layers))
        progress(f"pass time: {rows[-1]['nodes']} nodes, pipeline {rows[-1]['pipeline_s']:.2f}s")
    return rows
