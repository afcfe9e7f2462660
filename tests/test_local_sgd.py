"""LocalSGD on real processes (gloo over loopback), world sizes 2 and 4."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_schedules import documented_syncs
from tests.worlds import run_in_world


# the world of 2 is in the quick tier: LocalSGD's family there (tests/test_quick_worlds.py has the others), 3 s
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.quick), 4], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_in_world(world, "tests.localsgd_worker:checks", tmp_path_factory.mktemp(f"localsgd{world}"))


def test_k1_plain_sgd_matches_allreduce(runs):
    """Tolerance, not bitwise: mean(p - lr*g_r) is rounded differently from p - lr*mean(g_r)."""
    _, ranks = runs
    for ours, reference in zip(ranks[0]["k1"]["local_sgd"], ranks[0]["k1"]["allreduce"]):
        for name in ours:
            torch.testing.assert_close(ours[name], reference[name], atol=1e-6, rtol=1e-5)


def test_after_each_sync_all_ranks_hold_the_mean_of_their_pre_sync_parameters(runs):
    world, ranks = runs
    record = ranks[0]["means"]
    for t, variant in enumerate(record["variants"]):
        if variant != "sync":
            continue
        for name, post in record["post"][t].items():
            for other in ranks[1:]:  # identical on every rank, bitwise
                assert torch.equal(other["means"]["post"][t][name], post), f"step {t + 1}: {name} differs across ranks"
            mean = record["pre"][t][name].double().mean(0).float()
            torch.testing.assert_close(post, mean, atol=1e-6, rtol=1e-5)
    local_steps = [t for t, v in enumerate(record["variants"]) if v == "local"]
    assert local_steps, "the run must include local steps"
    t = local_steps[-1]
    differs = any(not torch.equal(ranks[1]["means"]["post"][t][n], p) for n, p in record["post"][t].items())
    assert differs, "between syncs, ranks train on their own data and drift apart"


def test_schedule_and_collective_count(runs):
    _, ranks = runs
    record = ranks[0]["means"]
    syncs = [t + 1 for t, v in enumerate(record["variants"]) if v == "sync"]
    assert syncs == documented_syncs(3, 2, 12) == [1, 2, 5, 8, 11]
    assert record["per_variant"]["local"] == 0
    # flatten-update holds every parameter in one flat buffer, averaged by one all-reduce whatever the (tiny)
    # bucket caps, as torch's model_averaging.average_parameters does; checkpoints keep a snapshot per parameter
    assert record["per_variant"]["sync"] == 1
    assert record["collectives"] == len(syncs)
    assert record["snapshot_in_state_dict"] == sorted(f"snapshot.{n}" for n in record["post"][0])


def test_adaptive_k_and_rank_averaged_loss(runs):
    world, ranks = runs
    syncs = ranks[0]["adaptive"]["syncs"]
    assert syncs and syncs[0][0] == 1
    loss_0, lr = None, 0.05
    for _, avg_loss, losses, k in syncs:
        assert avg_loss == pytest.approx(sum(losses) / world, rel=1e-6)
        loss_0 = loss_0 if loss_0 is not None else avg_loss
        assert k == min(max(math.ceil(math.sqrt(lr * avg_loss / (lr * loss_0) * 2)), 1), 16)
    for other in ranks[1:]:
        assert [s[3] for s in other["adaptive"]["syncs"]] == [s[3] for s in syncs]


def test_average_state_averages_optimizer_state_on_sync_steps_only(runs):
    """On a sync step each rank's momentum is the mean of every rank's momentum before the averaging (an eager
    twin computes those; tolerance as for the parameters: the mean is summed in another order); on a local step
    it is this rank's own, bit for bit, and the ranks differ."""
    _, ranks = runs
    syncs = [t for t, (variant, _, _) in enumerate(ranks[0]["averaged_state"]) if variant == "sync"]
    assert syncs == [0, 2], syncs  # k=2: steps 1 and 3
    for rank, results in enumerate(ranks):
        for t, (variant, post, pre) in enumerate(results["averaged_state"]):
            for name, buffer in post.items():
                if variant == "sync":
                    mean = pre[name].double().mean(0).float()
                    torch.testing.assert_close(buffer, mean, atol=1e-6, rtol=1e-5, msg=f"step {t + 1} {name}")
                else:
                    assert torch.equal(buffer, pre[name][rank]), f"rank {rank} step {t + 1} {name}"
    local = [t for t in range(len(ranks[0]["averaged_state"])) if t not in syncs]
    assert any(
        not torch.equal(ranks[0]["averaged_state"][t][1][n], ranks[1]["averaged_state"][t][1][n])
        for t in local
        for n in ranks[0]["averaged_state"][t][1]
    ), "between syncs the ranks' momentum drifts apart"
