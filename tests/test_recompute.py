"""The memory budget (``Execution(memory_budget=...)``, ``passes/recompute.py``) and the estimate it is judged by
(``step.memory_estimate()``, ``graph/memory.py``).

A budget changes where forward values are made, never their bits: the claim is ``torch.equal`` on weights and
losses against the same step without a budget, with dropout in every block (a recomputed random op would draw
new masks and fail it). The estimate is checked against what the step really allocates, from the profiler's
allocation records (``runtime/allocations.py``). Cost: about 110 s, the world of 2 (62 s) included (AMD EPYC, 2 cores).
"""

from __future__ import annotations

import copy
import operator

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from bench.memory_budget import checkpointed, eager_step
from bench.models import NarrowResNet
from passes.recompute_cost import repeatable
from tests.recompute_models import MODELS, DroppingGPT, gpt_batch
from tests.recompute_worker import MODES
from tests.worlds import run_in_world
from transpiler import ConfigurationError, Execution, NoSync, PassPipeline, TraceCache, transpile
from transpiler.runtime.allocations import allocated_peak

LOSS = nn.CrossEntropyLoss()


def _trained(
    model: nn.Module, batches: list, budget: float | None, steps: int = 10, traces: TraceCache | None = None
) -> tuple:
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    execution = Execution(memory_budget=budget)
    step = transpile(model, optimizer, NoSync(), LOSS, batches[0], execution=execution, trace=traces)
    torch.manual_seed(7)  # the dropout masks
    losses = [step(*batches[i % len(batches)]).detach().clone() for i in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()], step


# how far the measured peak may be from the estimate (the goal; both are exact to the byte here)
ESTIMATE_WITHIN = 0.10


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_every_budget_trains_bitwise_as_without_one_and_fits_it(name):
    make, batch_of = MODELS[name]
    torch.manual_seed(0)
    model, batches = make(), [batch_of(4, seed) for seed in range(3)]
    traces = TraceCache()  # one trace for every budget: each budget works on a copy
    losses, weights, plain = _trained(model, batches, None, traces=traces)
    unbudgeted = plain.memory_estimate().transient
    measured_unbudgeted = allocated_peak(lambda: plain(*batches[0]))
    for budget in (0.8, 0.65, 0.0):
        got_losses, got_weights, step = _trained(model, batches, budget, traces=traces)
        assert all(map(torch.equal, got_losses, losses)), (name, budget)
        assert all(map(torch.equal, got_weights, weights)), (name, budget)
        estimate = step.memory_estimate()
        assert "recompute" in step.program.decisions
        assert any("recomputed_from" in n.meta for n in step.program.graph.nodes)
        measured = allocated_peak(lambda: step(*batches[0]))  # noqa: B023 - called at once
        assert measured >= estimate.transient * (1 - ESTIMATE_WITHIN), (name, budget, measured)
        assert measured <= estimate.transient * (1 + ESTIMATE_WITHIN), (name, budget, measured)
        if budget:
            assert estimate.transient <= budget * unbudgeted, (name, budget)
            assert measured <= 1.05 * budget * measured_unbudgeted, (name, budget, measured)


class NativeDropout(nn.Module):
    """A ReLU after ``torch.native_dropout`` (one op making the output and the mask, taken out by ``getitem``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = torch.native_dropout(self.a(x), 0.5, True)
        return self.b(torch.relu(y))


@pytest.mark.quick
@pytest.mark.parametrize("make", [DroppingGPT, NativeDropout])
def test_dropout_is_kept_never_recomputed(make):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batch = (
        gpt_batch(4, 0) if make is DroppingGPT else (torch.randn(256, 8, generator=gen), torch.randint(0, 4, (256,)))
    )
    _, _, step = _trained(make(), [batch], 0.0, steps=1)
    recomputed = [n for n in step.program.graph.nodes if "recomputed_from" in n.meta]
    assert recomputed or make is not DroppingGPT
    assert not any(map(_draws, recomputed))
    attention = [n for n in recomputed if "scaled_dot_product" in str(n.target)]  # seeded for its dropout, at 0
    assert attention or make is not DroppingGPT
    # nor one of its outputs alone (the ReLU after a dropout reads one): a copy of that getitem would keep the
    # dropout's output and mask alive until the backward, uncounted
    assert all("recomputed_from" in n.args[0].meta for n in recomputed if n.target is operator.getitem)
    outputs = [n for n in step.program.graph.nodes if n.target is operator.getitem and _draws(n.args[0])]
    assert outputs or make is not NativeDropout
    assert not any(map(repeatable, outputs))


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a seeded op, but for CPU attention at ``dropout_p=0``."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        return (node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)) != 0
    return True


def _deep_cnn() -> tuple[nn.Module, tuple]:
    gen = torch.Generator().manual_seed(0)
    return NarrowResNet(blocks=8, channels=16), (torch.randn(8, 3, 12, 12, generator=gen), torch.randint(0, 10, (8,)))


def _gpt() -> tuple[nn.Module, tuple]:
    return DroppingGPT(), gpt_batch(8, 0)


@pytest.mark.parametrize("make", [_gpt, _deep_cnn], ids=["gpt", "cnn"])
def test_the_least_budget_holds_less_than_checkpointing_every_block(make):
    """The pass's least against the hand-made choice users make today, ``torch.utils.checkpoint`` around every
    block (eager, the same AdamW), measured alike. On the 8-block CNN the greedy alone stalled 7% above it (the
    recomputed residual stream chains: each block's copy needs the one before); the searches from the forward's
    cut values reach 20% below it. 8 samples: at 4 the test GPT's peak is its functional update's new weights and
    state, which no recompute lowers."""
    torch.manual_seed(0)
    model, batch = make()
    per_block = eager_step(checkpointed(model), batch)
    per_block()
    _, _, least = _trained(model, [batch], 0.0, steps=1)
    assert allocated_peak(lambda: least(*batch)) < allocated_peak(per_block)


class Checkpointed(nn.Module):
    """Blocks under the model's own ``torch.utils.checkpoint``."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
            x = x + y
        return self.head(x)


def test_a_model_that_checkpoints_itself_keeps_its_choice_until_a_budget_is_given():
    torch.manual_seed(0)
    plain, own = Checkpointed(False), Checkpointed(True)
    own.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen))]
    losses, weights, reference = _trained(plain, batches, None, steps=3)
    for budget in (None, 0.0):
        got_losses, got_weights, step = _trained(own, batches, budget, steps=3)
        assert all(map(torch.equal, got_losses, losses)) and all(map(torch.equal, got_weights, weights))
        graph_ops = sum(n.op == "call_function" for n in step.program.graph.nodes)
        if budget is None:  # the model's recomputation, as traced: more ops than the plain model's step
            assert graph_ops > sum(n.op == "call_function" for n in reference.program.graph.nodes)
        else:
            assert "merged back" in step.program.decisions["recompute"]


@pytest.mark.quick
def test_a_budget_the_step_cannot_reach_names_the_least_it_can():
    torch.manual_seed(0)
    model, batch = DroppingGPT(), gpt_batch(4, 0)
    with pytest.raises(ConfigurationError, match=r"cannot fit .* the least they reach is .* memory_budget=0"):
        transpile(
            model,
            torch.optim.AdamW(model.parameters()),
            NoSync(),
            LOSS,
            batch,
            execution=Execution(memory_budget_bytes=1),
        )
    with pytest.raises(ConfigurationError, match="not both"):
        Execution(memory_budget=0.5, memory_budget_bytes=10)
    with pytest.raises(ConfigurationError, match=r"memory_budget"):
        Execution(memory_budget=1.5)
    with pytest.raises(ConfigurationError, match="keep one of them"):
        transpile(
            model,
            torch.optim.AdamW(model.parameters()),
            PassPipeline(spec="recompute{memory-budget=0.5}"),
            LOSS,
            batch,
            execution=Execution(memory_budget=0.5),
        )


class RandomMLP(nn.Module):
    def __init__(self, widths: list[int], activation: str, norm: bool) -> None:
        super().__init__()
        act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[activation]
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), act()] + ([nn.LayerNorm(b)] if norm else [])
        self.body, self.head = nn.Sequential(*layers), nn.Linear(widths[-1], 3)

    def forward(self, x):
        return self.head(self.body(x))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(3, 24), min_size=2, max_size=5),
    activation=st.sampled_from(["relu", "gelu", "tanh"]),
    norm=st.booleans(),
    transformer=st.booleans(),
    budget=st.floats(0.0, 0.99),
)
def test_any_budget_gives_the_same_gradients_bitwise(widths, activation, norm, transformer, budget):
    """For random small MLPs and GPTs and a random budget (0: the least reachable), the step's gradients, its
    loss and new weights are bitwise those without one, or the budget is refused as out of reach."""
    torch.manual_seed(0)
    if transformer:
        model, batch = DroppingGPT(blocks=len(widths) - 1, dim=8, heads=2, seq=8), gpt_batch(2, 0, seq=8)
    else:
        model = RandomMLP(widths, activation, norm)
        batch = (torch.randn(6, widths[0]), torch.randint(0, 3, (6,)))
    reference = _one_sgd_step(model, batch, None)
    try:
        got = _one_sgd_step(model, batch, budget)
    except ConfigurationError as error:
        assert "the least they reach" in str(error)
        return
    assert all(map(torch.equal, got, reference))


def _one_sgd_step(model: nn.Module, batch: tuple, budget: float | None) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    step = transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        NoSync(),
        LOSS,
        batch,
        execution=Execution(memory_budget=budget),
    )
    torch.manual_seed(3)
    loss = step(*batch)
    return [loss.detach(), *(p.detach().clone() for p in model.parameters())]


def test_a_budget_is_bitwise_under_every_family_of_modes_at_two_ranks(tmp_path):
    """Each mode's passes see the copies as backward ops: ZeRO-3 gathers their parameters again, the
    low-communication modes sync what the backward made. Cost: 62 s alone (AMD EPYC, 2 cores) when each build
    traced anew; with one trace for all twelve, 21 s against 31 s the same hour on the 2-core Xeon."""
    ranks = run_in_world(2, "tests.recompute_worker:budgets", tmp_path, timeout=300)
    for rank in ranks:
        for mode, (_, budgets) in MODES.items():
            plain = rank[f"{mode},None"]
            for budget in budgets[1:]:
                got = rank[f"{mode},{budget}"]
                assert "recomputes" in got["decision"], (mode, budget)
                assert all(map(torch.equal, got["losses"], plain["losses"])), (mode, budget)
                assert all(map(torch.equal, got["weights"], plain["weights"])), (mode, budget)
    assert all(map(torch.equal, ranks[0]["zero3,0.0"]["weights"], ranks[1]["zero3,0.0"]["weights"]))
