"""Replica groups under a torchft quorum as real jobs on loopback: torchft's lighthouse and one torchrun job per
group, their workers forked from the suite's server (``bench/harness/zygote.py``). ``tests/test_quorum.py`` runs its
worker in them, ``tests/test_quorum_example.py`` the example of the docs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.harness import zygote
from bench.harness.launch import free_port


@contextlib.contextmanager
def lighthouse(
    out: Path, min_replicas: int = 2, join_timeout_ms: int | None = 1000, heartbeat_timeout_ms: int | None = 2000
) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """torchft's lighthouse, its address, and a list for the groups' torchrun jobs; on leaving, every job, its
    workers (torchrun starts each in a session of its own) and the lighthouse are gone. ``join_timeout_ms``: how
    long a quorum waits, from its first member's request, for the groups that heartbeat but have not asked yet;
    ``heartbeat_timeout_ms``: how long a silent group counts as alive (None: ``torchft_lighthouse``'s defaults)."""
    port = free_port()
    command, forks = zygote.lighthouse_command(["--min_replicas", str(min_replicas), "--bind", f"[::]:{port}"])
    if join_timeout_ms is not None:
        command += ["--join_timeout_ms", str(join_timeout_ms)]
    if heartbeat_timeout_ms is not None:
        command += ["--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    log = (out / "lighthouse.log").open("w")
    env = dict(os.environ, RUST_LOG="warn", **forks)
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    jobs: list[subprocess.Popen] = []
    try:
        time.sleep(0.5)
        yield f"http://localhost:{port}", jobs
    finally:
        for job in [*jobs, server]:
            workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
            for pid in [*map(int, workers), job.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            job.wait()


def torchrun_group(
    out: Path,
    group: str,
    address: str,
    script: Path,
    args: list[str],
    *,
    ranks: int = 1,
    max_restarts: int = 1,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Replica group ``group``: a torchrun job of ``ranks`` workers running ``script args`` with the lighthouse at
    ``address`` in ``$TORCHFT_LIGHTHOUSE`` and the group's id in ``$REPLICA_GROUP_ID`` (what the docs' commands
    set), its output in ``out/GROUP.log``."""
    worker, forks = zygote.torchrun_worker(script)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={group}",
        "--monitor-interval=0.5",
        *worker,
        *args,
    ]
    environment = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn", **forks, **(env or {}))
    environment.update(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=group)
    environment.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torch's default: the agent's store, shared
    log = (out / f"{group}.log").open("w")
    return subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
