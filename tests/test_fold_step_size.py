"""``reinplace-optimizer`` hands Adam's step size to ``addcdiv`` as its value, as eager does, instead of
multiplying it into ``exp_avg`` first (``passes/fold_step_size.py``): the bits of eager's multi-tensor call, and
no product tensor per parameter per step. Quick: about 6 s."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from passes.fold_step_size import fold_step_sizes
from transpiler import DiLoCo, StaticWorld, mode_config, transpile
from transpiler.graph.edit import emit

pytestmark = pytest.mark.quick
aten = torch.ops.aten
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _traced_update(shapes: list[tuple[int, ...]], dtype: torch.dtype, per_tensor: bool) -> fx.GraphModule:
    """The update as the twin traces it and ``foreach-update`` groups it: ``addcdiv(p, a * s, d)``, per tensor or
    as ``_foreach_mul.Tensor`` then ``_foreach_addcdiv.Scalar``."""
    graph, mode = fx.Graph(), FakeTensorMode()

    def inputs(name: str) -> list[fx.Node]:
        nodes = [graph.placeholder(f"{name}{i}") for i in range(len(shapes))]
        for node, shape in zip(nodes, shapes):
            node.meta["val"] = mode.from_tensor(torch.empty(shape, dtype=dtype))
        return nodes

    params, factors, denoms = inputs("p"), inputs("a"), inputs("d")
    scale = graph.placeholder("s")
    scale.meta["val"] = mode.from_tensor(torch.empty((), dtype=torch.float64))
    if per_tensor:
        products = [emit(graph, aten.mul.Tensor, (a, scale), role="optimizer") for a in factors]
        out = [emit(graph, aten.addcdiv.default, t, role="optimizer") for t in zip(params, products, denoms)]
    else:
        joined = emit(graph, aten._foreach_mul.Tensor, (factors, scale), role="optimizer")
        items = [emit(graph, operator.getitem, (joined, i), role="optimizer") for i in range(len(shapes))]
        update = emit(graph, aten._foreach_addcdiv.Scalar, (params, items, denoms, 1), role="optimizer")
        out = [emit(graph, operator.getitem, (update, i), role="optimizer") for i in range(len(shapes))]
    graph.output(out)
    return fx.GraphModule(nn.Module(), graph)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    per_tensor=st.booleans(),
    scale=st.floats(-1.0, -1e-6),
    seed=st.integers(0, 2**16),
)
def test_the_fold_computes_eagers_bits(sizes, dtype, per_tensor, scale, seed):
    """Odd sizes put elements in the kernels' vectorised body and scalar tail. Folded, the update is eager's
    ``_foreach_addcdiv_(p, a, d, [s, ...])`` (Python doubles, as AdamW passes them) bit for bit in every floating
    dtype; in float32 and float64 it is also what the traced form computed (the product's rounding is the
    kernel's), in bfloat16 and float16 not always (the product rounded on its own: the fold is the fix there)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n,) if i % 2 else (n, 3) for i, n in enumerate(sizes)]

    def draw(low: float) -> list[torch.Tensor]:
        return [(torch.rand(s, generator=gen, dtype=torch.float64) + low).to(dtype) for s in shapes]

    params, factors, denoms = draw(-0.5), draw(-0.5), draw(0.1)
    s = torch.tensor(scale, dtype=torch.float64)
    traced = _traced_update(shapes, dtype, per_tensor)
    before = traced(*params, *factors, *denoms, s)
    assert fold_step_sizes(traced.graph) == (len(shapes) if per_tensor else 1)
    traced.recompile()
    after = traced(*params, *factors, *denoms, s)
    assert not [n for n in traced.graph.nodes if n.target in (aten.mul.Tensor, aten._foreach_mul.Tensor)]
    eager = [p.clone() for p in params]
    torch._foreach_addcdiv_(eager, factors, denoms, [scale] * len(shapes))
    for a, b, e in zip(before, after, eager):
        assert torch.equal(b, e)
        if dtype in (torch.float32, torch.float64):
            assert torch.equal(a, b)


def _adamw_step(config, model: nn.Module, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return transpile(model, optimizer, config, nn.CrossEntropyLoss(), batch, mesh=StaticWorld(size=1, rank=0))


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [mode_config("fused_allreduce"), DiLoCo(sync_every=1000)], ids=str)
def test_adamws_programs_pass_the_step_size_as_a_value_and_train_as_eager(config, dtype):
    """The flat update (``fused_allreduce``) and the multi-tensor one (DiLoCo's inner step) on a CPU MLP: no op
    multiplies ``exp_avg`` by the step size slot; the update is ``_foreach_addcdiv_.Tensor``, in place; six steps
    bitwise against eager foreach AdamW, in float32 and in bfloat16 (which the traced product missed from the
    second step on)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3)).to(dtype)
    reference = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3)).to(dtype)
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 7, generator=gen).to(dtype), torch.randint(0, 3, (5,), generator=gen)) for _ in range(6)]
    step = _adamw_step(config, model, batches[0])
    eager = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    for x, y in batches:
        step(x, y)
        eager.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        eager.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
    program = next(iter(step.programs.values()))
    slot = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name.endswith("neg_step_size"))
    assert {u.target for u in slot.users} == {aten.repeat.default}
    targets = {n.target for n in program.graph.nodes}
    assert aten._foreach_addcdiv_.Tensor in targets and "step size" in program.decisions["reinplace-optimizer"]
