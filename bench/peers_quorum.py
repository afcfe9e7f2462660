"""The quorum's rows of ``bench/peers.py``: the digits job of ``bench/fault_tolerance.py``, fault-free, as two replica
groups of one rank under a torchft lighthouse (``fused_allreduce`` with ``FaultTolerance``), beside the same job as
torchft's users write it (its ``Manager`` + DDP wrapper, its default asynchronous quorum:
``bench/torchft_ddp_worker.py``) and beside the same job without a quorum (one torchrun job of two ranks); and ours
with a quorum only every ``QUORUM_EVERY`` committed steps (``FaultTolerance(quorum_every=...)``) beside no quorum.

Each group is a torchrun job of its own, so these cannot share the world the other rows run in: each path runs
``DURATION`` seconds, the paths in turn, ``ROUNDS`` times; a path's step is the run's time per committed step, the
ratio per round that of the two runs of that round, its median over the rounds. The MLP is widened (``--hidden
2048``, 360 samples per group and step) to the step of about 50 ms issue 77 sets the quorum's goal at, two groups
on two cores (a core each; ``bench/fault_tolerance.py`` runs three)."""

from __future__ import annotations

import statistics

from bench.fault_tolerance import QUORUM_EVERY, run, summary

OURS, PEER, BARE = "quorum", "torchft Manager + DDP", "no quorum"
EVERY = f"quorum every {QUORUM_EVERY}"  # ours, a quorum after every QUORUM_EVERY committed steps
ROUNDS, DURATION, GROUPS, BATCH, HIDDEN = 3, 15.0, 2, 360, 2048
TITLE = (
    f"The quorum: the digits job (bench/fault_tolerance.py, MLP hidden {HIDDEN}, {BATCH} samples per group) in "
    f"{GROUPS} replica groups of one rank, fault-free; {ROUNDS} rounds of {DURATION:.0f} s per path (ops, bytes and "
    "memory not counted: each group is a job of its own)"
)


def quorum_rounds() -> dict[str, list[float]]:
    """Each path's time per committed step (ms), one figure per round."""
    times: dict[str, list[float]] = {path: [] for path in (OURS, PEER, BARE, EVERY)}
    for _ in range(ROUNDS):
        for path in times:
            result = run(path, GROUPS, BATCH, DURATION, None, save_every=50, hidden=HIDDEN)
            times[path].append(summary(path, result)["mean_step_ms"])
    return times


def quorum_rows(times: dict[str, list[float]]) -> list[dict]:
    """``bench/peers.py``'s rows, timing only: ours against torchft's loop and against no quorum; ours with a
    quorum every ``QUORUM_EVERY`` steps against no quorum."""
    rows = []
    for ours, peer in ((OURS, PEER), (OURS, BARE), (EVERY, BARE)):
        ratio = statistics.median(a / b for a, b in zip(times[ours], times[peer]))
        ms = {"ours": statistics.median(times[ours]), "peer": statistics.median(times[peer])}
        rows.append({"labels": (f"fused_allreduce under a {ours}", peer), "ratio": ratio, "ms": ms})
    return rows
