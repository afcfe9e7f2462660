"""Elastic restarts end to end: the digits example under torchrun's elastic agent (``--nnodes 1:2``,
``--max-restarts``, the c10d rendezvous) on two hosts of two processes (network namespaces, bench/harness/hosts.py),
checkpointing every 10 steps. A rank or a host is lost mid-epoch; torchrun restarts the world, and the example
resumes from the newest checkpoint (transpiler.Checkpointer) at whatever world size the restart has.

The uninterrupted reference is the same job at 1 host × 4 on loopback (the ranks, data and reductions are
those of 2 × 2: tests/test_multihost.py shows the two bitwise equal).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from bench.harness.hosts import Hosts, namespaces_unavailable, torchrun, wait_all
from bench.harness.launch import ROOT
from tests.sample_logs import (
    assert_every_sample_once,
    attempts,
    counted_steps,
    final_scores,
    records,
    report_restarts,
    resumed_steps,
    wait_for_step,
)
from tests.worlds import run_in_world

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")
EXAMPLE = ROOT / "examples" / "train_digits.py"
EPOCHS, SAVE_EVERY, GLOBAL_BATCH = 8, 10, 128
TIMEOUT = 10  # the process group's, in seconds: above a restart's start-up on a loaded 2-core machine
JOB = ["--mode", "fused_allreduce", "--epochs", str(EPOCHS), "--global-batch", str(GLOBAL_BATCH)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The job without a failure, at W=4 (in the session's world of four, tests/worlds.py): its final loss and test
    accuracy, and every rank's loss at every step."""
    out = tmp_path_factory.mktemp("uninterrupted")
    samples = out / "samples"
    args = [*JOB, "--checkpoint-dir", str(out / "checkpoints"), "--save-every", str(SAVE_EVERY)]
    ranks = run_in_world(4, "tests.example_job:train", out, [*args, "--log-samples", str(samples)], timeout=240)
    losses = {(r["step"], r["rank"]): r["loss"] for r in records(samples)}
    return {"losses": losses, **final_scores(ranks[0]["stdout"])}


def elastic_job(tmp_path: Path, hosts, fault) -> tuple[list[int], str, Path]:
    """Both hosts' torchrun (``--nnodes 1:2 --max-restarts 3``) on the example with checkpoints; ``fault(hosts,
    logs)`` runs once training is under way. Returns the agents' exit codes, host 0's output, the sample logs."""
    logs, checkpoints = tmp_path / "samples", tmp_path / "checkpoints"
    args = [
        *JOB,
        "--checkpoint-dir",
        str(checkpoints),
        "--save-every",
        str(SAVE_EVERY),
        "--log-samples",
        str(logs),
        "--save-model",
        str(tmp_path / "model.pt"),
        "--timeout",
        str(TIMEOUT),
    ]
    agents = [
        torchrun(
            host,
            str(EXAMPLE),
            args,
            nnodes="1:2",
            nproc=2,
            endpoint=f"{hosts[0].address}:29412",
            run_id="elastic",
            max_restarts=3,
            log=tmp_path / f"host{i}.log",
        )
        for i, host in enumerate(hosts)
    ]
    fault(hosts, logs)
    codes = wait_all(agents[:1], timeout=240)
    return codes, (tmp_path / "host0.log").read_text(), logs


def test_a_killed_rank_restarts_the_world_bitwise_then_a_lost_host_leaves_a_world_of_two(tmp_path, uninterrupted):
    """Two faults in one job at 2 hosts × 2.

    First, SIGKILL one rank mid-epoch: torchrun restarts all four, and they resume from the newest checkpoint at
    W=4. Every step the restarted world runs computes the uninterrupted run's loss, bit for bit, on every rank:
    the weights it resumed from and every update since are the uninterrupted run's.

    Then kill every process of host 1, its agent included: the survivor's workers fail, torchrun
    re-rendezvouses at one host (W=4 → 2), the example reshards the W=4 checkpoint and finishes. Every sample
    is seen once per epoch over the steps that count. The final training loss is within 5% and the test
    accuracy within 0.02 of the uninterrupted run's: the same global batches in the same order, only summed as
    2 shard means instead of 4, a rounding difference that Adam's normalisation carries on."""
    with Hosts(2) as hosts:

        def kill_a_rank_then_host_one(hosts, logs):
            seen = wait_for_step(logs, 25)
            os.kill(next(r["pid"] for r in seen if r["rank"] == 3), signal.SIGKILL)
            wait_for_step(logs, 45, attempt=1)
            hosts[1].kill_all()

        codes, output, logs = elastic_job(tmp_path, hosts, kill_a_rank_then_host_one)
    assert codes == [0], output[-4000:]
    resumed = resumed_steps(output)
    assert len(resumed) == 2 and resumed[0] >= 20 and resumed[1] >= 40, output[-4000:]
    log = records(logs)
    report_restarts(log, ["a killed rank", "a lost host"])
    restarted = [r for r in log if r["attempt"] == attempts(log)[1]]
    assert {r["world"] for r in restarted} == {4} and min(r["step"] for r in restarted) == resumed[0] + 1
    for r in restarted:  # floats through JSON keep every bit
        assert r["loss"] == uninterrupted["losses"][r["step"], r["rank"]], (r["step"], r["rank"])
    counted = counted_steps(log, resumed)
    assert {c["world"] for c in counted.values()} == {4, 2}
    assert_every_sample_once(counted, EPOCHS, GLOBAL_BATCH)
    scores = final_scores(output)
    assert abs(scores["accuracy"] - uninterrupted["accuracy"]) <= 0.02, (scores, uninterrupted["accuracy"])
    assert abs(scores["loss"] - uninterrupted["loss"]) <= 0.05 * uninterrupted["loss"], (scores, uninterrupted["loss"])


def test_a_silent_partition_fails_within_the_timeout_naming_the_peer_and_the_survivors_go_on(tmp_path, uninterrupted):
    """Take host 1's link down mid-epoch: no process dies and no connection is reset, packets just stop. Host
    0's workers do not hang (elastic_job's limit): each fails when the process-group timeout runs out, with a
    CommunicationError naming the collective and host 1's ranks, 2 and 3; torchrun restarts them at one host
    (W=2), and they finish with every sample once per epoch."""
    with Hosts(2) as hosts:

        def partition(hosts, logs):
            wait_for_step(logs, 25)
            hosts[1].unplug()

        codes, output, logs = elastic_job(tmp_path, hosts, partition)
    assert codes == [0], output[-4000:]
    failures = re.findall(r"CommunicationError: rank (\d): (.*)", output)
    assert {rank for rank, _ in failures} == {"0", "1"}, output[-4000:]
    for _, message in failures:  # the other host's ranks are named; the wait was the timeout, not another error
        assert f"(timeout {TIMEOUT} s); waited for ranks 2, 3," in message, message
        assert float(re.search(r"failed after (\d+\.\d) s", message).group(1)) >= 0.9 * TIMEOUT, message
    log = records(logs)
    resumed = resumed_steps(output)
    counted = counted_steps(records(logs), resumed)
    report_restarts(log, ["a silent partition"])
    assert {c["world"] for c in counted.values()} == {4, 2}
    assert_every_sample_once(counted, EPOCHS, GLOBAL_BATCH)
