"""One rank of the AdaSum runs (launched by tests/test_adasum.py).

Each case gives every rank its own tensors (from a seed and the rank), runs
the AdaSum graph that the pass builds for this rank, and saves inputs and
outputs; the test compares them with an independent numpy reference. A second
part trains with modes adasum and adasum_delta on the same data on every rank; a
third trains mode adasum on each rank's own data (flat and, at W >= 4,
hierarchical), recording every rank's gradient from an eager twin so the test
can apply the published AdaSum to them step by step.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, make_batch  # noqa: E402
from passes.adasum import adasum_vector  # noqa: E402
from transpiler import AdaSum, transpile  # noqa: E402
from transpiler.graph.ports import Port
from transpiler.graph.program import StepProgram  # noqa: E402
from transpiler.graph.rank_layouts import AdaSumGeometry  # noqa: E402
from transpiler.runtime.process_group import resolve_placement, subgroup_names  # noqa: E402


def case_inputs(case: str, rank: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    if case == "odd_long":
        return [torch.randn(20 * world - 17, generator=gen)]
    if case == "odd_short":
        return [torch.randn(world + 2, generator=gen)]
    if case == "several":
        return [torch.randn(s, generator=gen) for s in (5, 13, 1)] + [torch.randn(4, 7, generator=gen)]
    if case == "orthogonal":  # one-hot directions, different per rank
        out = torch.zeros(2 * world)
        out[2 * rank] = 1.0 + rank
        return [out]
    if case == "collinear":
        return [torch.linspace(-1, 2, 9) * (0.5 + rank)]
    if case == "identical":
        return [torch.linspace(-3, 1, 11)]
    if case == "zero_on_odd_ranks":
        return [torch.zeros(10) if rank % 2 else torch.randn(10, generator=gen)]
    raise ValueError(case)


CASES = ("odd_long", "odd_short", "several", "orthogonal", "collinear", "identical", "zero_on_odd_ranks")


def run_adasum(inputs: list[torch.Tensor], rank: int, world: int, local_size: int) -> list[torch.Tensor]:
    geometry = AdaSumGeometry(world, local_size)
    placement = resolve_placement(None, None)
    graph = fx.Graph()
    mode = FakeTensorMode()
    nodes = []
    for i, t in enumerate(inputs):
        node = graph.placeholder(f"x{i}")
        node.meta.update(val=mode.from_tensor(t), port=Port("batch", f"x{i}"))
        nodes.append(node)
    output = graph.output(())
    program = StepProgram(fx.GraphModule(torch.nn.Module(), graph), [], [], world, rank, placement.group_name)
    program.subgroups = subgroup_names(placement, geometry.groups())
    output.args = (tuple(adasum_vector(program, nodes, geometry)),)
    program.recompile()
    return list(program.graph_module(*inputs))


def train(mode: str, rank: int, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    step = transpile(model, opt, mode, loss_fn=torch.nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(7)  # the same data on every rank
    for _ in range(steps):
        x, y = make_batch("mlp", 8, gen)
        step(x, y)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    return {
        "ours": {n: p.detach().clone() for n, p in model.named_parameters()},
        "eager": {n: p.detach().clone() for n, p in reference.named_parameters()},
    }


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_on_own_data(rank: int, world: int, local_size: int, steps: int = 3) -> list[dict]:
    """Mode adasum, plain SGD, each rank its own batches: per step the parameters before, every rank's gradient
    there (an eager twin's, all-gathered: [world, *shape]) and the parameters after."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    step = transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        AdaSum(target="grads", local_size=local_size),
        loss_fn=torch.nn.CrossEntropyLoss(),
    )
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    record = []
    for _ in range(steps):
        x, y = make_batch("mlp", 8, gen)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        grads = {}
        for n, p in twin.named_parameters():
            gathered = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(gathered, p.grad)
            grads[n] = torch.stack(gathered)
        before = params_of(model)
        step(x, y)
        record.append({"before": before, "grads": grads, "after": params_of(model)})
    return record


def checks(rank: int, world: int) -> dict:
    result = {"cases": {}, "hierarchical": {}, "train": {}}
    result["own_data"] = {size: train_on_own_data(rank, world, size) for size in ((1, 2) if world >= 4 else (1,))}
    for case in CASES:
        inputs = case_inputs(case, rank, world)
        result["cases"][case] = {"inputs": inputs, "outputs": run_adasum(inputs, rank, world, 1)}
    if world >= 4:
        inputs = case_inputs("several", rank, world)
        result["hierarchical"] = {"inputs": inputs, "outputs": run_adasum(inputs, rank, world, 2)}
    if world <= 4:
        result["train"] = {mode: train(mode, rank) for mode in ("adasum", "adasum_delta")}
    return result


if __name__ == "__main__":
    run_rank(checks)
