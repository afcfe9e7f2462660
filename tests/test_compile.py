"""``compile=True``: the rewritten program compiled by torch.compile, and its clear errors.

Parity at world size 2 (fused_allreduce, local_sgd, adasum) is in tests/test_boost.py, in the shared
world. Here: world size 1 with the wrapping strategies, and the errors, on small hand-made graphs.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

from tests.models import MLP, make_batch
from transpiler import ConfigurationError, transpile
from transpiler.collectives import C10D
from transpiler.compile import CompiledProgram, functional_copy


def test_world_size_1_with_wrappers_matches_the_uncompiled_step():
    """Within 1e-6 over 4 steps (Inductor fuses and reorders float arithmetic; measured 3e-8)."""
    results = []
    for compile_ in (False, True):
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        options = {"loss_scale": "dynamic", "max_grad_norm": 1.0}
        step = transpile(model, optimizer, "fused_allreduce", nn.CrossEntropyLoss(), compile=compile_, **options)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            step(*make_batch("mlp", 8, gen))
        results.append((list(model.parameters()), step))
    (plain, _), (compiled, step) = results
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(plain, compiled))
    assert set(step.compile_seconds) == {"step"} and step.compile_seconds["step"] > 0


def _graph(body) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(body(graph, x))
    return fx.GraphModule(torch.nn.Module(), graph)


def _sign_branch(x: torch.Tensor) -> torch.Tensor:
    return x + 1 if x.sum() > 0 else x - 1  # data-dependent control flow: no single graph


def test_a_program_that_cannot_be_compiled_is_a_clear_error_before_it_runs():
    gm = _graph(lambda g, x: g.call_function(_sign_branch, (x,)))
    with pytest.raises(ConfigurationError, match="'step' program of this mode cannot be compiled.*compile=False"):
        CompiledProgram(gm, "step")(torch.ones(3))


def test_an_in_place_all_reduce_whose_buffer_is_read_later_is_refused():
    def body(g, x):
        reduced = g.call_function(C10D.all_reduce_.default, (x, "sum", "world"))
        waited = g.call_function(C10D.wait_tensor.default, (reduced,))
        return g.call_function(operator.add, (waited, x))  # reads the buffer the all-reduce overwrote

    with pytest.raises(ConfigurationError, match="read the buffer afterwards"):
        functional_copy(_graph(body))


def test_compile_takes_a_bool():
    model = MLP()
    with pytest.raises(ConfigurationError, match="compile must be True or False"):
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), compile="yes")
