"""Start the suite's rank processes as forks of a server that has imported torch and the package already.

A rank started as ``python script.py`` spends 5 to 10 s of CPU importing torch, its tracing stack, this package and
the libraries the checks use before its first line of work (docs/ci_runs.md). Each
pytest process here starts one multiprocessing *forkserver*, which imports them once (``bench.harness.zygote_preload``),
and every rank is a fork of it: with its own environment, arguments, working directory, log and (for a world's
rank) stdin, running its script as ``__main__`` as the interpreter would (but for the script's own folder, which
is not searched first for imports: every script here imports by package, ``tests.x`` or ``bench.x``), and leaving
without interpreter finalisation, as ``launch.run_rank`` does.

The server imports and nothing else: no tensor op, no thread (OpenBLAS's pool is kept to the main thread by
``OMP_NUM_THREADS=1``, which every rank has anyway), so a fork of it is as clean as a fresh interpreter. What a
fresh interpreter reads from the environment at import time (ATen's ``ATEN_CPU_CAPABILITY``, the thread count)
is the same here: the server starts with the suite's environment, and ranks set their thread count themselves.
torchrun's workers and torchft's lighthouse come here too, through a client (``bench/harness/forked.py``) and a server
forked from this one (``bench/harness/fork_server.py``; :func:`torchrun_worker`, :func:`lighthouse_command`); torchrun's
agents start their own interpreters (forked, one restarted world in three failed: docs/design.md).
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from bench.harness.launch import ROOT

_CONTEXT = multiprocessing.get_context("forkserver")


def _ensure_server() -> None:
    """Start this process's server once, with one OpenMP/OpenBLAS thread (it must have no thread but its own)."""
    multiprocessing.forkserver.set_forkserver_preload(["bench.harness.zygote_preload"])
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def start(argv: list[str], env: dict[str, str], log: Path, *, stdin_fd: int | None = None) -> BaseProcess:
    """Fork a rank running ``python *argv`` (a script path, or ``-m module``) with exactly ``env``, writing its
    output to ``log`` (appended) and reading its stdin from ``stdin_fd`` (closed here once handed over)."""
    _ensure_server()
    stdin = Connection(stdin_fd, writable=False) if stdin_fd is not None else None
    process = _CONTEXT.Process(target=_run, args=(argv, env, str(ROOT), str(log), stdin), daemon=False)
    process.start()
    if stdin is not None:
        stdin.close()
    return process


def forked_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """A command that runs as ``python -u *argv`` (a script, or ``-m module``) would, in a fork of this process's
    server (``bench/harness/fork_server.py``, started on first use) instead of a new interpreter; and the environment it
    needs for that."""
    return [sys.executable, "-u", str(ROOT / "bench" / "harness" / "forked.py"), *argv], {
        "FORK_SERVER": _worker_server()
    }


def torchrun_worker(script: Path | str) -> tuple[list[str], dict[str, str]]:
    """What a torchrun command names instead of ``script`` so that its workers are forks of this process's server
    (``bench/harness/fork_server.py``, started on first use), and the environment torchrun must pass on for it."""
    return [str(ROOT / "bench" / "harness" / "forked.py"), str(script)], {"FORK_SERVER": _worker_server()}


def lighthouse_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """torchft's lighthouse (its ``torchft_lighthouse`` command, ``bench/harness/lighthouse.py``) with ``args``,
    forked."""
    return forked_command([str(ROOT / "bench" / "harness" / "lighthouse.py"), *args])


@functools.cache
def _worker_server() -> str:
    """Start this process's torchrun-worker server, a fork of the rank server; its address."""
    from bench.harness import fork_server

    _ensure_server()
    address = str(Path(tempfile.mkdtemp(prefix="forks-")) / "server")
    server = _CONTEXT.Process(target=fork_server.serve, args=(address,), daemon=True)
    server.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(address):
        assert server.is_alive() and time.monotonic() < deadline, "the worker server did not start"
        time.sleep(0.01)
    return address


def _run(argv: list[str], env: dict[str, str], cwd: str, log: str, stdin: Connection | None) -> None:
    """The rank, in the fork: become ``python *argv`` started in ``cwd`` with ``env``. A native crash (a signal
    such as SIGSEGV) prints every thread's Python stack to the log (``faulthandler``), so a rank that dies that
    way says where its threads were instead of leaving an empty log."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    become(argv, env, cwd, stdout=out, stderr=out, stdin=stdin.fileno() if stdin is not None else None)
    os.close(out)
    if stdin is not None:
        stdin.close()
    faulthandler.enable(all_threads=True)
    run_as_main(argv)


def become(argv: list[str], env: dict[str, str], cwd: str, *, stdout: int, stderr: int, stdin: int | None) -> None:
    """Make this fork the process ``python -u *argv`` would start in ``cwd`` with ``env`` and these descriptors as
    its standard streams (copied onto 0, 1 and 2; the caller closes its own)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    if stdin is not None:
        os.dup2(stdin, 0)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the rank's stdin for its whole life
    sys.argv = [argv[1], *argv[2:]] if argv[0] == "-m" else list(argv)


def run_as_main(argv: list[str]) -> None:
    """Run the script (or ``-m`` module) of ``argv`` as ``__main__``, once :func:`become` has set the process up."""
    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
