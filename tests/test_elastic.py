"""Elastic restarts end to end: the digits example under torchrun's elastic agent (``--nnodes 1:2``,
``--max-restarts``, the c10d rendezvous) on two hosts of two processes (network namespaces, bench/harness/hosts.py),
checkpointing every 10 steps. A rank or a host is lost mid-epoch; torchrun restarts the world, and the example
resumes from the newest checkpoint (transpiler.Checkpointer) at whatever world size the restart has.

The uninterrupted reference is the same job at 1 host × 4 on loopback (the ranks, data and reductions are
those of 2 × 2: tests/test_multihost.py shows the two bitwise equal).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest

from bench.harness.hosts import Hosts, namespaces_unavailable, torchrun, wait_all
from bench.harness.launch import ROOT
from tests.worlds import run_in_world
from transpiler import DataPosition

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")
EXAMPLE = ROOT / "examples" / "train_digits.py"
EPOCHS, SAVE_EVERY, GLOBAL_BATCH = 8, 10, 128
TRAIN_SAMPLES = 1437  # digits' 1797 less the 20% test split
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


def final_scores(output: str) -> dict[str, float]:
    """The final weights' loss on the whole training set and test accuracy, as rank 0 prints them."""
    found = re.findall(r"train loss (\d+\.\d+); test accuracy (\d\.\d+)", output)
    assert found, output[-2000:]
    return {"loss": float(found[-1][0]), "accuracy": float(found[-1][1])}


def records(log_dir: Path) -> list[dict]:
    out = []
    for path in sorted(log_dir.glob("rank*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return out


def attempts(log: list[dict]) -> list[float]:
    """The attempts (each rank 0's start time) in the order they ran."""
    return sorted({r["attempt"] for r in log})


def wait_for_step(log_dir: Path, step: int, attempt: int = 0, timeout: float = 120) -> list[dict]:
    """Poll the sample logs until all four ranks of the ``attempt``-th attempt (0: the first) have logged ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = records(log_dir)
        runs = attempts(log)
        seen = [r for r in log if r["attempt"] == runs[attempt] and r["step"] >= step] if len(runs) > attempt else []
        if len({r["rank"] for r in seen}) == 4:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"attempt {attempt} of the job did not reach step {step} within {timeout} s")


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


def counted_steps(log: list[dict], resumed_at: list[int]) -> dict[int, dict]:
    """The steps that made the final model: each attempt's steps up to the checkpoint the next attempt resumed
    from (``resumed_at[i]``: where attempt i+1 started), by step number, with every rank's sample ids."""
    by_attempt: dict[float, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in log:
        by_attempt[r["attempt"]][r["step"]].append(r)
    order = attempts(log)
    assert len(order) == len(resumed_at) + 1, (order, resumed_at)
    counted = {}
    for i, attempt in enumerate(order):
        start = resumed_at[i - 1] if i else 0
        end = resumed_at[i] if i < len(resumed_at) else max(by_attempt[attempt])
        for step in range(start + 1, end + 1):
            entries = by_attempt[attempt][step]
            assert entries, f"attempt {attempt} never ran step {step}"
            counted[step] = {"world": entries[0]["world"], "epoch": entries[0]["epoch"], "entries": entries}
    return counted


def assert_every_sample_once(counted: dict[int, dict]) -> None:
    """Every step from 1 to the last counted exactly once, each with all of its world's ranks; per epoch, the
    samples of the counted steps are the epoch's permutation, each sample once."""
    assert sorted(counted) == list(range(1, max(counted) + 1))
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for step in sorted(counted):
        entries = sorted(counted[step]["entries"], key=lambda r: r["rank"])
        assert [r["rank"] for r in entries] == list(range(counted[step]["world"])), (step, entries)
        for r in entries:
            per_epoch[counted[step]["epoch"]].extend(r["ids"])
    position = DataPosition(TRAIN_SAMPLES, GLOBAL_BATCH)
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)) == position.steps_per_epoch * GLOBAL_BATCH, epoch
        assert ids == position.order(epoch)[: len(ids)].tolist(), epoch


def report_restarts(log: list[dict], faults: list[str]) -> None:
    """Print what each fault cost (docs/fault_tolerance.md quotes it; ``pytest tests/test_elastic.py -s`` shows
    it): seconds from the last step before it to the first step after, and the steps run twice. Measured, not
    asserted."""
    runs = attempts(log)
    for fault, first, second in zip(faults, runs, runs[1:]):
        before = [r for r in log if r["attempt"] == first]
        after = [r for r in log if r["attempt"] == second]
        gap = min(r["time"] for r in after) - max(r["time"] for r in before)
        redone = max(r["step"] for r in before) - min(r["step"] for r in after) + 1
        print(f"\n{fault}: {gap:.1f} s from the last step before to the first step after; {redone} steps run again")


def resumed_steps(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"resumed from \S*step-(\d{8})", output)]


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
    assert_every_sample_once(counted)
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
    assert_every_sample_once(counted)
