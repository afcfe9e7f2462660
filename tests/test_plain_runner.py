"""The plain runner (``transpiler/runtime/plain_runner.py``) folds what is the same every step, and nothing else,
lets a copy cast, and calls each op's C++ entry without a Python frame.

Each rule on a graph written here, run against the unfolded graph; then a transformers GPT-2 with dropout under
bf16 autocast, whose folded step is bitwise its unfolded one step after step; then the direct calls, counted with a
profile hook, on a step that runs them bitwise as the program's own module. Quick: about 7 s.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from transpiler import transpile
from transpiler.runtime.failures import failing_node
from transpiler.runtime.plain_runner import MAX_FOLDED_BYTES, PlainRunner, direct_calls, plain_runner, runs_on_gpu

pytestmark = pytest.mark.quick
aten = torch.ops.aten


def module(build, example: torch.Tensor, **buffers: torch.Tensor) -> fx.GraphModule:
    """A graph module whose graph ``build(graph, attrs)`` writes, with these buffers as its attributes, and each
    node's value (``meta["val"]``) as tracing records it, for the input ``example``."""
    root = nn.Module()
    for name, value in buffers.items():
        root.register_buffer(name, value)
    graph = fx.Graph()
    graph.output(build(graph, {name: graph.get_attr(name) for name in buffers}))
    gm = fx.GraphModule(root, graph)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(example)
    return gm


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_view_of_an_attribute_folds_even_where_an_op_writes_through_it():
    def build(g, a):
        x = g.placeholder("x")
        slot = g.call_function(aten.as_strided.default, (a["bucket"], [2, 2], [2, 1], 4))
        g.call_function(aten.mm.out, (x, x), {"out": slot})
        return (g.call_function(aten.clone.default, (a["bucket"],)),)

    gm = module(build, torch.ones(2, 2), bucket=torch.zeros(8))
    run = plain_runner(gm)
    assert aten.as_strided.default not in targets(run) and aten.mm.out in targets(run)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(run(x)[0], torch.tensor([0, 0, 0, 0, 7, 10, 15, 22.0]))
    gm.bucket.zero_()
    assert torch.equal(gm(x)[0], run(x)[0])


def test_an_allocation_that_is_written_or_returned_stays_fresh_every_step():
    def build(g, a):
        x = g.placeholder("x")
        fresh = g.call_function(aten.zeros.default, ([2, 2],))
        g.call_function(aten.copy_.default, (g.call_function(aten.view.default, (fresh, [4])), x))
        returned = g.call_function(aten.arange.default, (4,))
        return (fresh, returned)

    run = plain_runner(module(build, torch.ones(4)))
    assert targets(run).count(aten.zeros.default) == 1 and aten.arange.default in targets(run)
    first, _ = run(torch.ones(4))
    second, _ = run(torch.full((4,), 2.0))
    assert first is not second and torch.equal(first, torch.ones(2, 2))


def test_random_ops_ops_on_attributes_and_large_results_are_not_folded():
    big = MAX_FOLDED_BYTES // 4 + 1

    def build(g, a):
        x = g.placeholder("x")
        ones = g.call_function(aten.ones.default, ([4],))
        drop = g.call_function(aten.bernoulli.p, (ones, 0.5))
        total = g.call_function(aten.sum.default, (a["state"],))  # the step may write an attribute
        large = g.call_function(aten.sum.default, (g.call_function(aten.ones.default, ([big],)),))
        return (g.call_function(aten.add.Tensor, (g.call_function(aten.mul.Tensor, (x, drop)), total)), large)

    run = plain_runner(module(build, torch.ones(4), state=torch.ones(3)))
    kept = targets(run)
    assert aten.bernoulli.p in kept and aten.sum.default in kept and kept.count(aten.ones.default) == 1
    torch.manual_seed(0)
    a = run(torch.ones(4))[0]
    torch.manual_seed(1)
    assert not all(torch.equal(a, run(torch.ones(4))[0]) for _ in range(8))  # still drawn every call


def test_a_constant_computed_from_factories_folds_and_gives_the_same_result():
    def build(g, a):
        x = g.placeholder("x")
        steps = g.call_function(aten.arange.default, (4,), {"dtype": torch.float32})
        half = g.call_function(aten.scalar_tensor.default, (0.5,))
        mask = g.call_function(aten.where.self, (g.call_function(aten.gt.Scalar, (steps, 1)), steps, half))
        return (g.call_function(aten.mul.Tensor, (x, mask)),)

    gm = module(build, torch.ones(4))
    run = plain_runner(gm)
    assert targets(run) == [aten.mul.Tensor]
    x = torch.randn(4)
    assert torch.equal(run(x)[0], gm(x)[0])


def test_a_copy_casts_where_the_cast_was_only_for_it_and_to_its_dtype():
    def build(g, a):
        x = g.placeholder("x")  # float32
        widened = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.float64})  # read by the copy alone
        g.call_function(aten.copy_.default, (a["wide"], widened))
        rounded = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})  # then widened again
        g.call_function(aten.copy_.default, (a["narrow"], rounded))
        shared = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.float64})  # read twice
        g.call_function(aten.copy_.default, (a["other"], shared))
        return (g.call_function(aten.clone.default, (shared,)),)

    buffers = {
        "wide": torch.zeros(5, dtype=torch.float64),
        "narrow": torch.zeros(5),
        "other": torch.zeros(5, dtype=torch.float64),
    }
    gm = module(build, torch.ones(5), **buffers)
    run = plain_runner(gm)
    assert targets(run).count(aten._to_copy.default) == 2 and targets(run).count(aten.copy_.default) == 3
    x = torch.randn(5, generator=torch.Generator().manual_seed(0)) * 1e3
    run(x)
    assert torch.equal(run.wide, x.double()) and torch.equal(run.narrow, x.bfloat16().float())
    folded = {name: getattr(run, name).clone() for name in buffers}  # the runner shares the buffers with gm
    for name in buffers:
        getattr(gm, name).zero_()
    gm(x)
    assert all(torch.equal(getattr(gm, name), folded[name]) for name in buffers)


def test_a_graph_without_constants_is_run_as_it_is():
    def build(g, a):
        return (g.call_function(aten.neg.default, (g.placeholder("x"),)),)

    gm = module(build, torch.ones(4))
    assert plain_runner(gm) is gm


def test_gpt2_with_dropout_under_autocast_folds_and_keeps_its_bits():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = transformers.GPT2LMHeadModel(config)

        def forward(self, tokens):
            return self.inner(input_ids=tokens, labels=tokens, use_cache=False).loss

    torch.manual_seed(0)
    model = LM()
    twin = copy.deepcopy(model)
    steps = []
    for m in (model, twin):
        steps.append(transpile(m, torch.optim.AdamW(m.parameters(), lr=1e-3), "fused_allreduce", None))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        built = steps[0].prepare((ids,))
    # the plain runner, as a GPU's step has it; the twin's only calls the ops directly, as the CPU's does
    built.runners = {v: PlainRunner(p.graph_module, fold=True) for v, p in built.programs.items()}
    for i in range(3):
        losses = []
        for step in steps:
            torch.manual_seed(10 + i)  # the same dropout masks for both
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(step(ids))
        assert torch.equal(*losses)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    built = steps[0]._state.built
    run, program = built.runners["step"].module, built.programs["step"].graph_module
    assert run is not program and not runs_on_gpu(program)
    assert not steps[1]._state.built.runners["step"].fold
    assert targets(run).count(aten.as_strided.default) < targets(program).count(aten.as_strided.default)
    assert targets(run).count(aten.bernoulli.p) == targets(program).count(aten.bernoulli.p) > 0


def python_calls(run) -> Counter:
    """The Python functions ``run()`` enters, by name (a profile hook sees every Python frame pushed)."""
    calls: Counter = Counter()

    def hook(frame, event, _arg):
        if event == "call":
            calls[frame.f_code.co_qualname] += 1

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_direct_calls_push_no_python_frame_per_op_and_keep_every_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    loss_fn = nn.CrossEntropyLoss()
    steps = [transpile(m, torch.optim.AdamW(m.parameters()), "none", loss_fn, (x, y)) for m in (model, twin)]
    built = steps[1].prepare((x, y))
    built.runners = {v: p.graph_module for v, p in built.programs.items()}  # as built: OpOverload.__call__ per op
    for _ in range(3):
        assert torch.equal(steps[0](x, y), steps[1](x, y))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    program = built.programs["step"].graph_module
    run = steps[0]._state.built.runners["step"].module
    ops = sum(isinstance(t, torch._ops.OpOverload) for t in targets(program))
    assert ops > 50 and targets(run) == targets(program)  # the copy's graph still names the ops
    values = (n.meta["val"] for n in program.graph.nodes if n.op == "placeholder")
    inputs = [torch.ones(v.shape, dtype=v.dtype) for v in values]
    assert python_calls(lambda: program(*inputs))["OpOverload.__call__"] >= ops
    assert python_calls(lambda: run(*inputs))["OpOverload.__call__"] == 0


def test_direct_calls_leave_the_module_they_copy_as_it_was():
    def build(g, _):
        x = g.placeholder("x")
        return (g.call_function(aten.mul.Tensor, (g.call_function(aten.sin.default, (x,)), x)),)

    gm = module(build, torch.ones(3))
    code = gm.code
    run = direct_calls(gm)
    x = torch.randn(3)
    assert torch.equal(run(x)[0], gm(x)[0]) and gm.code == code and "torch.ops.aten" in code
    assert "torch.ops" not in run.code and targets(run) == targets(gm)


def test_a_failure_in_the_direct_copy_names_its_node_as_the_program_does():
    def build(g, _):
        x = g.placeholder("x")
        return (g.call_function(aten.mm.default, (g.call_function(aten.relu.default, (x,)), x)),)

    run = PlainRunner(module(build, torch.ones(2, 2)))
    with pytest.raises(RuntimeError) as failed:
        run(torch.ones(2, 3))  # mm of 2x3 by 2x3
    node = failing_node(failed.value, run.module)
    assert node is not None and node.name == "mm_default" and node.target is aten.mm.default
