"""Ranks that disagree, stall or die fail loudly and fast; models that failed before match DDP at world size 2.

Real gloo processes (tests/safety_worker.py). The session's world of two ranks (tests/worlds.py) runs every
check that leaves its process group healthy; each fault (a stalled rank, a rank that changes its setup alone, a
rank that dies) breaks its group, so it gets a world of its own with a 3 s timeout.

Parity against DDP(broadcast_buffers=False) (our modes keep buffers local
after the startup broadcast, so DDP must not re-broadcast rank 0's BatchNorm
statistics every forward): bitwise at world size 2, for the reasons given in
test_parity.py, except nn.GRU (within 1e-6; see test_real_models_w1.py).
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.launch import ROOT, launch
from tests.worlds import run_in_world

WORKER = ROOT / "tests" / "safety_worker.py"


def _run(kind: str, tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp(kind)
    launch(WORKER, 2, [str(out), kind], timeout=240)
    # a rank that died on purpose saves nothing
    return [torch.load(path, weights_only=False) for path in sorted(out.glob("rank*.pt"))]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_in_world(2, "tests.safety_worker:checks", tmp_path_factory.mktemp("world"), ("world",))


@pytest.mark.parametrize(
    "case, message",
    [
        ("k_steps", r"schedule: k_steps: rank 0 2, rank 1 3"),
        ("bucket_cap", r"mode: step: rank 0 '.*fuse-allreduce,.*', rank 1 '.*fuse-allreduce\{bucket-cap-mb=0.001\}"),
        ("mode", r"mode: step: .*fuse-allreduce.*rank 1 '.*allreduce-grads"),
        ("hidden_size", r"parameters differ at entry 0: rank 0 'net.0.weight' float32\[32, 20\], rank 1 .*\[40, 20\]"),
        ("extra_layer", r"parameters: rank 0 6 entries, rank 1 8; rank 1 also has '1.weight'"),
        ("eval_on_one_rank", r"training differ at entry 0: rank 0 module '<root>' in train mode, rank 1 .* eval"),
    ],
)
def test_ranks_started_differently_fail_on_every_rank(world, case, message):
    for rank, results in enumerate(world):
        seen = results["mismatch"][case]
        assert seen["type"] == "RankMismatchError", seen
        assert seen["message"].startswith(f"rank {rank}:")
        assert __import__("re").search(message, seen["message"]), seen["message"]


@pytest.mark.parametrize("name", ["lstm", "gru", "checkpoint", "maxnorm", "dropout_bn", "gpt2", "llama"])
def test_models_that_failed_before_match_ddp(world, name):
    if name not in world[0]:
        pytest.skip("transformers is not installed")
    for ours, ddp in world[0][name]["steps"]:
        for key, value in ours.items():
            if name == "gru":
                torch.testing.assert_close(value, ddp[key], atol=1e-6, rtol=1e-5)
            else:
                assert torch.equal(value, ddp[key]), f"{name}: {key} differs from DDP"
    if name == "maxnorm":  # max_norm renormalises the rows each rank looked up, in DDP as here: ranks drift
        return
    for ours_0, ours_1 in zip(world[0][name]["steps"], world[1][name]["steps"]):
        for key in ours_0[0]:
            if not key.endswith(("running_mean", "running_var")):  # BatchNorm statistics are per rank
                assert torch.equal(ours_0[0][key], ours_1[0][key])


def test_train_eval_switch_retraces_once_and_handshakes_again(world):
    assert world[0]["dropout_bn"]["traces"] == 2 and world[0]["dropout_bn"]["handshakes"] == 2


def test_every_group_takes_the_default_timeout_or_the_explicit_one(world):
    """AdaSum's subgroups used a hard-coded 10 minutes; the worker's default group has 60 s."""
    timeouts = world[0]["timeouts"]
    assert len(timeouts["default"]) >= 2 and set(timeouts["default"]) == {60.0}
    assert len(timeouts["explicit"]) >= 2 and set(timeouts["explicit"]) == {7.0}


def test_consistent_mid_run_freeze(world):
    for results in world:
        assert results["freeze"] == {"unchanged": True, "handshakes": 2}


def test_checkpoint_restores_each_ranks_batchnorm_statistics(world):
    assert world[0]["restore"]["same"] and world[1]["restore"]["same"]
    assert not torch.equal(world[0]["restore"]["running_mean"], world[1]["restore"]["running_mean"])


@pytest.mark.parametrize("kind", ["stall", "freeze_one", "die"])
def test_faults_fail_within_the_timeout_naming_what_failed(kind, tmp_path_factory):
    survivor = _run(kind, tmp_path_factory)[0]
    assert survivor["type"] == "CommunicationError", survivor
    assert "rank 0:" in survivor["message"]
    if kind != "freeze_one":
        assert "all_reduce" in survivor["message"] and "bucket" in survivor["message"]
        assert "waited for ranks 1," in survivor["message"], survivor["message"]  # the stalled or dead peer
    # no bound on how fast: a hang would have ended the world at launch()'s timeout, not in an error; a stalled
    # peer stays silent until rank 0 has saved its outcome, or 4 x the timeout: had the survivor waited for it, the
    # step would have raised nothing (tests/safety_worker.py stay_silent)


def test_a_rank_silent_while_a_checkpoint_is_written_fails_within_the_steps_timeout(tmp_path_factory):
    """A link cut while DCP writes fails as one cut mid-step: a CommunicationError naming the save and the
    silent rank, from the step's 3 s group, not a raw gloo error after the default group's 60 s."""
    survivor = _run("stall_in_save", tmp_path_factory)[0]
    assert survivor["type"] == "CommunicationError", survivor
    message = survivor["message"]
    assert message.startswith("rank 0: saving the checkpoint ") and ".partial-00000000" in message, message
    assert "(timeout 3 s); waited for ranks 1," in message, message
    assert survivor["seconds"] < 30, survivor  # the step's group timed out, not the default one (60 s)
