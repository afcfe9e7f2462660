"""The suite's rank server (tests/zygote.py): a rank forked from it is what ``python script.py`` would start, as
far as the rank can tell: its environment, arguments, folder, kernels, threads, output, input and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests import zygote
from tests.distributed import ROOT, rank_env

PROBE = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch
    line = sys.stdin.readline().strip() if len(sys.argv) > 2 else None
    seen = {
        "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "name": __name__,
        "capability": torch.backends.cpu.get_cpu_capability(), "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")), "stdin": line,
        "folder_on_path": os.path.dirname(os.path.abspath(__file__)) in sys.path,
    }
    print(json.dumps(seen))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)


def _fresh(script, env, args):
    done = subprocess.run([sys.executable, str(script), *args], env=env, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, json.loads(done.stdout.splitlines()[0])


def test_a_forked_rank_sees_what_a_fresh_interpreter_would(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = rank_env(1, 2, 1234) | {"ATEN_CPU_CAPABILITY": "default", "PROBE_ONLY": "here"}
    log = tmp_path / "rank.log"
    read, write = os.pipe()
    rank = zygote.start([str(script), "3", "with-stdin"], env, log, stdin_fd=read)
    with os.fdopen(write, "w") as orders:
        orders.write("an order\n")
    rank.join(timeout=60)
    assert rank.exitcode == 3, log.read_text()
    printed = log.read_text().splitlines()
    forked = json.loads(printed[0])
    assert printed[1:] == ["to stderr"]
    code, fresh = _fresh(script, env, ["3"])
    assert code == 3
    assert forked.pop("stdin") == "an order" and fresh.pop("stdin") is None
    assert forked.pop("argv") == ["3", "with-stdin"] and fresh.pop("argv") == ["3"]
    fresh_env, forked_env = fresh.pop("env"), forked.pop("env")
    assert forked_env == env and forked_env["PROBE_ONLY"] == "here"
    assert {k: fresh_env[k] for k in env if k in fresh_env} == env  # the interpreter may add its own (LC_CTYPE)
    assert forked == fresh, (forked, fresh)  # name, folder, kernels ("DEFAULT"), one thread, script folder on path
    assert forked["capability"] == "DEFAULT" and forked["native_threads"] == 1


def test_a_rank_that_raises_exits_1_with_its_traceback_in_its_log(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise ValueError('from the rank')\n")
    log = tmp_path / "rank.log"
    rank = zygote.start([str(script)], rank_env(0, 1, 1234), log)
    rank.join(timeout=60)
    assert rank.exitcode == 1
    assert "ValueError: from the rank" in log.read_text()
