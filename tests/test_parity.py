"""Parity of the data-parallel modes with DDP and single-process training.

Real processes on gloo over loopback (tests/dist_worker.py), world sizes 2
and 4, modes allreduce and fused_allreduce (fused with tiny bucket caps, so
several buckets are formed, and with ``bucket_cap_mb="auto"``), SGD with momentum and Adam, on an MLP, a CNN with
BatchNorm and a model with tied weights, 5 steps each.

Where parity is bitwise, and why:
* against DDP at world size 2: the loss-gradient seed is scaled by 1/2 (exact,
  a power of two, so every backward op scales exactly), and a sum of two
  values does not depend on the order gloo adds them. Parameters and
  optimizer state are compared with torch.equal after every step.
* at world size 4 the per-element summation order of gloo's ring all-reduce
  depends on where an element sits in its buffer, and our buckets differ from
  DDP's, so the last bit may differ: tolerance ATOL/RTOL.
* against single-process training on the full batch: the mean over the full
  batch and the mean of per-shard means round differently: tolerance. With
  BatchNorm, data parallelism normalises each shard by its own statistics (as
  DDP does without SyncBatchNorm), so the single-process reference for the CNN
  runs the shards one after another in one process, summing 1/W-scaled grads.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.worlds import run_in_world

pytestmark = pytest.mark.bitwise  # claims eager's or DDP's bits: run again under narrower kernels in .ci/run

MODELS, OPTIMIZERS, MODES = ("mlp", "cnn", "tied"), ("sgd", "adam"), ("allreduce", "fused_allreduce")
SCENARIOS = [",".join(s) for s in itertools.product(MODELS, OPTIMIZERS, MODES)] + [
    "mlp,sgd,fused_auto",
    "cnn,adam,fused_auto",
    "mlp,adam,fused_flat",  # gradient_as_bucket_view=False: no out= views at all
    "tied,sgd,fused_flat",
]
ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=pytest.mark.within_tolerance)], ids=lambda w: f"world{w}"
)
def runs(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"parity{world}")
    # below pytest-timeout, so a hang is reported by the session, which kills every rank
    return world, run_in_world(world, "tests.dist_worker:checks", out, (";".join(SCENARIOS),), timeout=240)


def _compare(ours: dict, other: dict, *, bitwise: bool, what: str, keys=("params", "state", "buffers")) -> None:
    for key in keys:
        for name, value in ours[key].items():
            if bitwise:
                assert torch.equal(value, other[key][name]), f"{what}: {key} {name} differs"
            else:
                torch.testing.assert_close(value, other[key][name], atol=ATOL, rtol=RTOL, msg=f"{what}: {key} {name}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_ddp_and_single_process(runs, scenario):
    world, ranks = runs
    record = ranks[0][scenario]
    for step, (ours, ddp, single) in enumerate(zip(record["ours"], record["ddp"], record["single"])):
        _compare(ours, ddp, bitwise=world == 2, what=f"{scenario} step {step} vs DDP (world {world})")
        _compare(ours, single, bitwise=False, what=f"{scenario} step {step} vs single process", keys=("params",))
        for other_rank in ranks[1:]:  # every rank ends each step with the same parameters
            _compare(
                other_rank[scenario]["ours"][step],
                ours,
                bitwise=True,
                what=f"{scenario} step {step} across ranks",
                keys=("params", "state"),
            )
    for ours_loss, ddp_loss in record["losses"]:
        assert ours_loss == pytest.approx(ddp_loss, rel=1e-6)


def test_tied_weight_reduced_once(runs):
    """The tied embedding/projection weight has one gradient and one all-reduce; the frozen one has none."""
    _, ranks = runs
    assert ranks[0]["tied,sgd,allreduce"]["collectives"] == 2  # tied weight + projection bias


def test_auto_bucket_caps_are_chosen_alike_on_every_rank(runs):
    """``bucket_cap_mb="auto"`` measured a cost model, said what it chose, and every rank chose the same."""
    _, ranks = runs
    for scenario in ("mlp,sgd,fused_auto", "cnn,adam,fused_auto"):
        decision = ranks[0][scenario]["decisions"]["fuse-allreduce"]
        assert decision.startswith("bucket_cap_mb=auto chose"), decision
        assert all(r[scenario]["decisions"]["fuse-allreduce"] == decision for r in ranks[1:])  # one agreed model
        assert all(r[scenario]["collectives"] == ranks[0][scenario]["collectives"] for r in ranks[1:])
