"""Worlds of ranks kept for the whole test session, each running one worker's body after another.

Starting a world costs every rank a process (a fork of the suite's rank server, ``bench/harness/zygote.py``, which has
imported torch and the package already), the libraries only some checks use, and a process group, paid again by
every file that needs a world. So a world of W ranks (gloo on loopback, 60 s timeout, one thread, as
``distributed.run_rank``) starts the first time a test asks for it and then serves every test that needs W ranks,
in any file: each worker's body (``checks`` of ``tests/zero_worker.py``, say) is a *job*, run by every rank with
the same arguments, its results saved as ``rank<r>.pt``, exactly as a world launched for it alone would save them.

A job that fails, or outlives its timeout, may leave the other ranks inside a collective: that world is killed,
the error shows each rank's output and how it ended, and the next job starts a new world. A job during which a rank
died of a native crash (SIGSEGV, SIGABRT...: torch 2.13's gloo corrupts its heap now and then, docs/design.md
"Known limits") runs once more in a new world, with a warning that carries the crashed run's output; a second crash
fails the test. A Python error, a wrong result or a timeout is never retried. A world is never shared with a job that
breaks it on purpose (``tests/safety_worker.py``'s faults launch their own, ``distributed.launch``). Jobs share
a process, so a job must leave nothing behind that changes another's results (a patched module, a global
default); torch's RNG, the one thing jobs commonly change, starts each job from a fresh process's seed.

The session ends the worlds it started (``close_all``, from ``conftest.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TextIO

from bench.harness import zygote
from bench.harness.launch import ending, free_port, rank_env

SETTLE = 2.0  # seconds a failed job's ranks get to leave before their exit codes are read
NATIVE_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}


class RankCrashed(AssertionError):
    """A rank died of a native crash (a signal, not a Python error) during a job."""


class RetriedAfterCrash(UserWarning):
    """A job ran a second time because a rank died of a native crash the first time (the crash's output)."""


class World:
    """``size`` ranks waiting for jobs on their stdin; :meth:`run` hands them one and waits, without polling, for
    each rank to report its end (``done:JOB:RANK`` or ``failed:JOB:RANK`` in the named pipe ``reports`` of the
    folder ``control``) or to die."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.control = Path(tempfile.mkdtemp(prefix=f"world{size}-"))
        self.jobs = 0
        os.mkfifo(self.control / "reports")
        # read and write: the pipe stays open between a rank's reports, and a rank's open never waits for a reader
        self.reports = os.open(self.control / "reports", os.O_RDWR | os.O_NONBLOCK)
        port = free_port()
        self.logs = [self.control / f"rank{r}.log" for r in range(size)]  # a file, never a pipe nobody reads
        self.procs: list[BaseProcess] = []
        self.orders: list[TextIO] = []  # each rank's stdin, a pipe
        for rank in range(size):
            self.logs[rank].touch()
            read, write = os.pipe()
            command = ["-m", "tests.worlds", str(self.control)]
            self.procs.append(zygote.start(command, rank_env(rank, size, port), self.logs[rank], stdin_fd=read))
            self.orders.append(os.fdopen(write, "w"))

    def run(self, target: str, out: Path, args: list[str], *, timeout: float) -> None:
        """Run ``module:function`` on every rank as ``function(rank, world, *args)``, its results saved in ``out``;
        fail with every rank's output if any rank fails, dies or is not done within ``timeout``."""
        job = self.jobs
        self.jobs += 1
        starts = [log.stat().st_size for log in self.logs]
        order = json.dumps({"job": job, "target": target, "out": str(out), "args": args})
        for orders in self.orders:
            orders.write(order + "\n")
            orders.flush()
        deadline = time.monotonic() + timeout
        ended: dict[str, set[int]] = {"done": set(), "failed": set()}
        while True:
            for report in os.read(self.reports, 65536).decode().split() if wait([self.reports], 0) else ():
                what, at_job, rank = report.split(":")
                if int(at_job) == job:
                    ended[what].add(int(rank))
            if len(ended["done"]) == self.size:
                return
            failed = sorted(ended["failed"])
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            late = time.monotonic() > deadline
            if failed or dead or late:
                exits = [p.exitcode for p in self.procs] if late else self._settled_exits()
                crashed = [r for r, code in enumerate(exits) if code is not None and -code in NATIVE_CRASHES]
                why = f"did not finish in {timeout}s (hang?)" if late else f"failed on ranks {failed or dead}"
                for p in self.procs:
                    p.kill()
                output = self._output(starts, exits)
                self.close()
                error = RankCrashed if crashed else AssertionError
                raise error(f"{target} with {self.size} ranks {why}:\n{output}")
            wait([self.reports, *(p.sentinel for p in self.procs)], timeout=max(deadline - time.monotonic(), 0))

    def alive(self) -> bool:
        return all(p.exitcode is None for p in self.procs)

    def close(self) -> None:
        for orders in self.orders:  # end of input: the rank leaves
            try:
                orders.close()
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join()
        if self.reports >= 0:  # a world closed after a failed job is closed again at the session's end
            os.close(self.reports)
            self.reports = -1
        shutil.rmtree(self.control, ignore_errors=True)

    def _settled_exits(self) -> list[int | None]:
        """Each rank's exit code once every rank has left or :data:`SETTLE` seconds have passed: a rank that
        crashes takes its peers down within a moment (their collectives fail), and whichever is seen first, the
        crash must be told apart from a Python error."""
        deadline = time.monotonic() + SETTLE
        while any(p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
            wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=deadline - time.monotonic())
        return [p.exitcode for p in self.procs]

    def _output(self, starts: list[int], exits: list[int | None]) -> str:
        """What each rank printed since the job began (less faulthandler's list of extension modules, which would
        crowd out the stacks), and how it ended."""
        shown = []
        for rank, (log, start, code) in enumerate(zip(self.logs, starts, exits)):
            with log.open() as f:
                f.seek(start)
                lines = f.read().splitlines(keepends=True)
            printed = "".join(line for line in lines if not line.startswith("Extension modules:"))
            shown.append(f"--- rank {rank} ({ending(code)}):\n{printed[-3000:]}")
        return "\n".join(shown)


_WORLDS: dict[int, World] = {}


def run_in_world(size: int, target: str, out: Path, args: tuple = (), *, timeout: float = 240) -> list[Any]:
    """Run a job in the session's world of ``size`` ranks (starting one if there is none, or it was lost) and
    return each rank's results, in rank order (our own files: loaded whole, not ``weights_only``)."""
    import torch

    for attempt in range(2):
        world = _WORLDS.get(size)
        if world is None or not world.alive():
            world = _WORLDS[size] = World(size)
        try:
            world.run(target, out, [str(a) for a in args], timeout=timeout)
            break
        except RankCrashed as crash:
            if attempt:
                raise
            warnings.warn(RetriedAfterCrash(f"ran again in a new world after a native crash: {crash}"), stacklevel=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(size)]


def close_all() -> None:
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


def report(control: Path, what: str, job: int, rank: int) -> None:
    """Tell the session that this rank's job ended: one write of a few bytes to a pipe is atomic."""
    fd = os.open(control / "reports", os.O_WRONLY)
    try:
        os.write(fd, f"{what}:{job}:{rank}\n".encode())
    finally:
        os.close(fd)


def serve(control: Path) -> None:
    """A rank of a world: join it, then run each job as it arrives until told to stop."""
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    fresh_seed = torch.initial_seed()
    for line in sys.stdin:
        order = json.loads(line)
        job = order["job"]
        print(f"=== job {job}: {order['target']} {order['args']}", flush=True)
        try:
            module, _, name = order["target"].partition(":")
            body = getattr(importlib.import_module(module), name)
            torch.manual_seed(fresh_seed)
            result: Any = body(rank, size, *order["args"])
            torch.save(result, os.path.join(order["out"], f"rank{rank}.pt"))
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            report(control, "failed", job, rank)
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        report(control, "done", job, rank)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
