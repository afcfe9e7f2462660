"""AdaSum on real processes (gloo over loopback) against an independent numpy reference.

The reference is the AdaSum tree from the paper: pairs (0,1), (2,3), ... are
combined first, then the pairs of pairs, with per-tensor coefficients
``(1 - a·b/(2|a|²)) a + (1 - a·b/(2|b|²)) b`` in float64. The graph computes the
same value by recursive vector halving with point-to-point exchanges.
Tolerance: relative L2 error below 100·eps(float32) per tensor.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.helpers import adasum_tree, eager_step
from tests.worlds import run_in_world
from transpiler import ConfigurationError, StaticWorld, transpile

EPS32 = float(np.finfo(np.float32).eps)


def rel_err(got: torch.Tensor, want: np.ndarray) -> float:
    got = got.double().numpy().ravel()
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_in_world(world, "tests.adasum_worker:checks", tmp_path_factory.mktemp(f"adasum{world}"))


CASES = ("odd_long", "odd_short", "several", "orthogonal", "collinear", "identical", "zero_on_odd_ranks")


@pytest.mark.parametrize("case", CASES)
def test_matches_the_reference_tree_on_every_rank(runs, case):
    world, ranks = runs
    inputs = [[t.numpy() for t in r["cases"][case]["inputs"]] for r in ranks]
    expected = adasum_tree(inputs)
    for r in ranks:
        for got, want in zip(r["cases"][case]["outputs"], expected, strict=True):
            assert rel_err(got, want) < 100 * EPS32, f"{case}: relative error {rel_err(got, want):.2e}"


def test_identities(runs):
    world, ranks = runs
    out = {case: ranks[0]["cases"][case]["outputs"][0].double() for case in CASES}
    inp = {case: [r["cases"][case]["inputs"][0].double() for r in ranks] for case in CASES}
    tol = {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(out["orthogonal"], sum(inp["orthogonal"]), **tol)  # orthogonal: the sum
    torch.testing.assert_close(out["collinear"], sum(inp["collinear"]) / world, **tol)  # collinear: the mean
    torch.testing.assert_close(out["identical"], inp["identical"][0], **tol)  # identical: the input
    if world == 2:  # a zero input gives the other
        torch.testing.assert_close(out["zero_on_odd_ranks"], inp["zero_on_odd_ranks"][0], **tol)


def test_hierarchical_against_its_own_reference(runs):
    world, ranks = runs
    if world < 4:
        pytest.skip("local_size=2 needs at least 4 ranks")
    inputs = [[t.double().numpy() for t in r["hierarchical"]["inputs"]] for r in ranks]
    group_means = [[(a + b) / 2 for a, b in zip(inputs[i], inputs[i + 1])] for i in range(0, world, 2)]
    expected = adasum_tree(group_means)
    for r in ranks:
        for got, want in zip(r["hierarchical"]["outputs"], expected, strict=True):
            assert rel_err(got, want) < 100 * EPS32


def test_training_with_identical_data_on_every_rank_is_plain_training(runs):
    """AdaSum of identical gradients is the gradient: bitwise (the coefficients are exactly 1/2)."""
    world, ranks = runs
    if world > 4:
        pytest.skip("trained at world sizes 2 and 4")
    for r in ranks:
        ours, eager = r["train"]["adasum"]["ours"], r["train"]["adasum"]["eager"]
        assert all(torch.equal(ours[n], eager[n]) for n in ours)
        ours, eager = r["train"]["adasum_delta"]["ours"], r["train"]["adasum_delta"]["eager"]
        for n in ours:  # old + (new - old) rounds: a tolerance
            torch.testing.assert_close(ours[n], eager[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("local_size", [1, 2])
def test_training_on_each_ranks_own_data_follows_the_published_adasum(runs, local_size):
    """Each rank trains on its own batches (where AdaSum is not the mean). Step by step, from every rank's
    gradient (an eager twin's), numpy applies the published AdaSum (hierarchical: the mean within each pair of
    ranks, then the tree across pairs) and plain SGD in float64: every rank's parameters are that, within
    float32 rounding, and the same on every rank, bit for bit."""
    world, ranks = runs
    if local_size == 2 and world < 4:
        pytest.skip("local_size=2 needs at least 4 ranks")
    record = ranks[0]["own_data"][local_size]
    assert len(record) == 3
    for t, step in enumerate(record):
        for name, before in step["before"].items():
            grads = step["grads"][name].double().numpy()
            if local_size == 2:
                grads = np.stack([(grads[i] + grads[i + 1]) / 2 for i in range(0, world, 2)])
            assert not np.allclose(grads[0], grads[-1]), "the ranks must see different data"
            combined = adasum_tree([[g] for g in grads])[0].reshape(tuple(before.shape))
            expected = torch.from_numpy(before.double().numpy() - 0.05 * combined)
            for r in ranks:
                after = r["own_data"][local_size][t]["after"][name]
                assert torch.equal(after, step["after"][name]), f"step {t + 1} {name}: ranks differ"
            torch.testing.assert_close(step["after"][name].double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("world", [3, 6, 12])
def test_non_power_of_two_world_size_is_a_clear_error(world):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigurationError, match="power-of-two"):
        transpile(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            "adasum",
            loss_fn=torch.nn.MSELoss(),
            example_inputs=(torch.randn(2, 3), torch.randn(2, 2)),
            mesh=StaticWorld(size=world),
        )


@pytest.mark.quick
def test_world_size_one_is_the_plain_optimizer():
    """With one rank there is no partner: no exchange, and three steps are eager SGD's, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    twin = copy.deepcopy(model)
    batch = (torch.randn(2, 3), torch.randn(2, 2))
    step = transpile(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "adasum", loss_fn=torch.nn.MSELoss(), example_inputs=batch
    )
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    assert not any("p2p" in n.meta for n in step.graph_module.graph.nodes)
    for _ in range(3):
        assert torch.equal(step(*batch), eager_step(twin, twin_opt, torch.nn.MSELoss(), batch))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
