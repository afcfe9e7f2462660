"""The digits example's sample logs (``--log-samples``: one JSON line per rank and step, with its attempt, pid,
world, epoch, loss and sample ids) and its output, read back by the restart tests (``test_elastic.py``,
``test_restarts.py``): which steps made the final model, and whether every sample was seen once per epoch."""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path

from transpiler import DataPosition

TRAIN_SAMPLES = 1437  # digits' 1797 less the 20% test split


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


def wait_for_step(log_dir: Path, step: int, attempt: int = 0, timeout: float = 120, ranks: int = 4) -> list[dict]:
    """Poll the sample logs until all ``ranks`` ranks of the ``attempt``-th attempt (0: the first) have logged
    ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = records(log_dir)
        runs = attempts(log)
        seen = [r for r in log if r["attempt"] == runs[attempt] and r["step"] >= step] if len(runs) > attempt else []
        if len({r["rank"] for r in seen}) == ranks:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"attempt {attempt} of the job did not reach step {step} within {timeout} s")


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


def assert_every_sample_once(counted: dict[int, dict], epochs: int, global_batch: int) -> None:
    """Every step from 1 to the last counted exactly once, each with all of its world's ranks; per epoch, the
    samples of the counted steps are the epoch's permutation, each sample once."""
    assert sorted(counted) == list(range(1, max(counted) + 1))
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for step in sorted(counted):
        entries = sorted(counted[step]["entries"], key=lambda r: r["rank"])
        assert [r["rank"] for r in entries] == list(range(counted[step]["world"])), (step, entries)
        for r in entries:
            per_epoch[counted[step]["epoch"]].extend(r["ids"])
    position = DataPosition(TRAIN_SAMPLES, global_batch)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)) == position.steps_per_epoch * global_batch, epoch
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
