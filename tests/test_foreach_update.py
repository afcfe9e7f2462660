"""``foreach-update``: the updates ``flatten-update`` leaves per parameter run as ``_foreach_*`` ops
(``passes/foreach_update.py``), single-process. bfloat16 is the case that needs it: ``add(..., alpha=)`` rounds
differently on a flat buffer (docs/bitwise.md), so those buckets stay per parameter, and LAMB's per-tensor norms
keep any dtype per parameter. Each step is held to eager ``optimizer.step()`` (the for-loop) bit for bit where
the per-parameter program is eager's, and to the per-parameter program everywhere."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.tiny_models import Lamb, Lion
from passes.foreach_update import ForeachUpdate
from tests.helpers import assert_same_training_state, eager_step
from transpiler import StaticWorld, transpile

LOSS = nn.CrossEntropyLoss()
# traced from their own step(): the per-parameter program is eager's bits in bfloat16 too
GENERIC = {
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=False),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=False),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, foreach=False),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
    "lamb": lambda ps: Lamb(ps),
}
# the functional twins: not eager's bits in bfloat16 with or without this pass (test_flat_update.py says why)
TWINS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
}


def mlp(widths: list[int], dtype: torch.dtype) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def foreach_ops(step) -> list[str]:
    return [str(n.target) for n in step.program.graph.nodes if str(n.target).startswith("aten._foreach_")]


def run(model, make, batch, steps: int, monkeypatch=None):
    """``steps`` transpiled steps (W=1) of ``model``; with ``monkeypatch``, without ``foreach-update``."""
    if monkeypatch is not None:
        monkeypatch.setattr(ForeachUpdate, "run", lambda self, program: False)
    optimizer = make(model.parameters())
    step = transpile(model, optimizer, "fused_allreduce", LOSS, batch, mesh=StaticWorld(size=1, rank=0))
    losses = [step(*batch) for _ in range(steps)]
    if monkeypatch is not None:
        monkeypatch.undo()
    return optimizer, step, losses


@pytest.mark.bitwise
@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.integers(1, 29), min_size=2, max_size=4),
    name=st.sampled_from(sorted(GENERIC)),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_updates_are_multi_tensor_and_eager_bit_for_bit(widths, name, seed):
    """Every parameter's update is in one group (one param group, one dtype), each multi-tensor op replaces one
    per parameter, and three steps keep eager's bits for every tensor, whatever the sizes."""
    torch.manual_seed(seed)
    model = mlp([*widths, 3], torch.bfloat16)
    twin = copy.deepcopy(model)
    twin_opt = GENERIC[name](twin.parameters())
    batch = (torch.randn(5, widths[0]).bfloat16(), torch.randint(0, 3, (5,)))
    optimizer, step, losses = run(model, GENERIC[name], batch, 3)
    for loss in losses:
        assert torch.equal(loss, eager_step(twin, twin_opt, LOSS, batch))
    assert_same_training_state(model, optimizer, twin, twin_opt)
    assert not step.program.flat_buffers
    assert (
        foreach_ops(step) and f"{len(list(model.parameters()))} parameters" in step.program.decisions["foreach-update"]
    )


@pytest.mark.parametrize("name", sorted(TWINS))
def test_twins_in_bfloat16_compute_what_the_per_parameter_program_does(name, monkeypatch):
    """The twins' bfloat16 update as multi-tensor ops is the per-parameter program, bit for bit, for four steps;
    every op of the chain has a multi-tensor twin, so none stays per parameter. (Per parameter, Adam's ``addcdiv``
    is a multi-tensor op of one tensor: its step size a value, ``fold_step_size.py``.)"""
    torch.manual_seed(7)
    model = mlp([9, 11, 3], torch.bfloat16)
    reference = copy.deepcopy(model)
    batch = (torch.randn(6, 9).bfloat16(), torch.randint(0, 3, (6,)))
    optimizer, step, losses = run(model, TWINS[name], batch, 4)
    ref_opt, ref_step, ref_losses = run(reference, TWINS[name], batch, 4, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert_same_training_state(model, optimizer, reference, ref_opt)
    assert set(foreach_ops(ref_step)) <= {"aten._foreach_addcdiv_.Tensor"}
    assert step.program.decisions["foreach-update"].endswith("as one multi-tensor op each")
    merged, total = step.program.decisions["foreach-update"].split(": ")[1].split(" ops")[0].split(" of ")
    folded = int("step size" in step.program.decisions.get("reinplace-optimizer", ""))  # Adam's product: gone
    assert merged == total and len(foreach_ops(step)) == int(merged) - folded
    assert folded == (name != "sgd")


def test_float32_lamb_keeps_its_norms_per_parameter_and_the_rest_multi_tensor():
    """LAMB's trust ratio reads whole-tensor norms, so flatten-update leaves it per parameter in any dtype: its
    element-wise ops become multi-tensor ones, the norms stay one per parameter, and the step is eager's bits."""
    torch.manual_seed(3)
    model = mlp([7, 13, 5, 3], torch.float32)
    twin = copy.deepcopy(model)
    twin_opt = Lamb(twin.parameters())
    batch = (torch.randn(5, 7), torch.randint(0, 3, (5,)))
    optimizer, step, losses = run(model, Lamb, batch, 3)
    for loss in losses:
        assert torch.equal(loss, eager_step(twin, twin_opt, LOSS, batch))
    assert_same_training_state(model, optimizer, twin, twin_opt)
    norms = [n for n in step.program.graph.nodes if n.target is torch.ops.aten.linalg_vector_norm.default]
    assert len(norms) == 2 * len(list(model.parameters()))  # the parameter's and its update's, each
    assert foreach_ops(step)


def test_the_number_of_update_ops_does_not_grow_with_the_model():
    """A bfloat16 GPT with AdamW: 4 blocks or 12, the update dispatches the same ops (one multi-tensor op per
    term of the formula, and the step size repeated once for ``addcdiv``: ``fold_step_size.py``), where per
    parameter it would be three times as many."""
    from bench.models import NarrowGPT, narrow_batch

    counts = []
    for blocks in (4, 12):
        torch.manual_seed(0)
        model = NarrowGPT(blocks=blocks).bfloat16()
        batch = narrow_batch("gpt", 2, torch.Generator().manual_seed(0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        step = transpile(model, optimizer, "fused_allreduce", LOSS, batch, mesh=StaticWorld(size=1, rank=0))
        step(*batch)
        update = [
            n
            for n in step.program.graph.nodes
            if n.meta.get("role") == "optimizer" and isinstance(n.target, torch._ops.OpOverload)
        ]
        counts.append(len(update))
    assert counts[0] == counts[1] == len(foreach_ops(step)) + 1, counts


@pytest.mark.parametrize("device, dtype, cast", [("meta", torch.float32, True), ("cpu", torch.float32, False)])
def test_a_float64_operand_is_cast_once_to_the_tensors_dtype_off_the_cpu(device, dtype, cast):
    """CUDA's multi-tensor kernels take a 0-d operand only in the tensors' dtype, else they run one kernel per
    tensor: off the CPU (here the meta device) the per-step float64 scalar is cast once to the tensors' dtype; on
    the CPU, where every ``_foreach_*`` op runs per tensor anyway, the call stays as it was. (That the cast keeps
    the bits is checked on a GPU: tests/test_gpu.py.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from passes.foreach_update import _operand_in_the_tensors_dtype
    from transpiler.graph.edit import Cursor

    graph = torch.fx.Graph()
    a, b, s = (graph.placeholder(name) for name in ("a", "b", "s"))
    with FakeTensorMode():
        a.meta["val"], b.meta["val"] = (torch.empty(4, device=device, dtype=dtype) for _ in range(2))
        s.meta["val"] = torch.empty((), device=device, dtype=torch.float64)
    args = _operand_in_the_tensors_dtype(Cursor(graph, s), ([a, b], s))
    assert args[0] == [a, b]
    if cast:
        assert args[1].target is torch.ops.aten._to_copy.default and args[1].args == (s,)
        assert args[1].meta["val"].dtype == dtype and args[1].meta["val"].dim() == 0
    else:
        assert args[1] is s


@pytest.mark.quick
def test_a_second_schedule_keeps_in_place_updates_before_their_readers():
    """An in-place multi-tensor op returns nothing, so a reader of the tensors it wrote records it (``meta
    ["after"]``) and the schedule keeps that order: run again on zero3's finished Adam program, it moves nothing
    (it used to move ``exp_avg_sq``'s update after the square root that reads it). In bfloat16, whose ``add``
    rounds differently in a flat buffer, so that the update stays multi-tensor."""
    from tests.helpers import strategy_of
    from transpiler.build import rewrite
    from transpiler.runtime.process_group import Placement
    from transpiler.trace.tracer import trace_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2)).bfloat16()
    batch = (torch.randn(4, 2).bfloat16(), torch.randn(4, 2).bfloat16())
    traced = trace_step(model, torch.optim.Adam(model.parameters(), lr=0.1), nn.MSELoss(), batch)[0].program
    passes = strategy_of("zero3", reshard_after_forward=False).variants["step"]
    program = rewrite(traced, passes, Placement(1, 0, "world", False))
    square_root = next(n for n in program.graph.nodes if n.target is torch.ops.aten._foreach_sqrt.default)
    assert [n.target for n in square_root.meta["after"]] == [torch.ops.aten._foreach_addcmul_.Scalar]
    assert next(p for p in passes if p.name == "schedule-collectives").run(program) is False


def test_optimizer_state_is_fed_without_a_dispatch_per_tensor():
    """A per-parameter program reads every state tensor as an input each step. They are fed as they are, with no
    ``detach()`` each (a dispatch per tensor per step, 447 a step for AdamW on a 149-tensor model): one step
    dispatches a detach per parameter (its input) and none per state tensor (AdamW with amsgrad: 4 each)."""
    torch.manual_seed(5)
    model = mlp([9, 11, 3], torch.bfloat16)
    batch = (torch.randn(6, 9).bfloat16(), torch.randint(0, 3, (6,)))
    optimizer, step, _ = run(model, TWINS["adam"], batch, 2)
    assert not step.program.flat_buffers and len(optimizer.state) == 4
    with DetachCounter() as counted:
        step(*batch)
    assert counted.detaches == len(list(model.parameters())), counted.detaches


class DetachCounter(TorchDispatchMode):
    """Counts the ``aten.detach`` dispatches while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.detaches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.detaches += func is torch.ops.aten.detach.default
        return func(*args, **(kwargs or {}))
