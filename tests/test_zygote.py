"""The suite's rank server (bench/harness/zygote.py): a rank forked from it is what ``python script.py`` would start, as
far as the rank can tell: its environment, arguments, folder, kernels, threads, output, input and exit code. The
same for torchrun's workers forked by ``bench/harness/fork_server.py``, whose signals and exit codes pass through the
client torchrun starts (``bench/harness/forked.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.harness import zygote
from bench.harness.launch import ROOT, rank_env

PROBE = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch
    line = sys.stdin.readline().strip() if len(sys.argv) > 2 else None
    seen = {
        "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "name": __name__,
        "capability": torch.backends.cpu.get_cpu_capability(), "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")), "stdin": line,
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


WORKER_PROBE = textwrap.dedent(
    """
    import json, os, signal, socket, sys, threading, time
    import torch
    out, rank = sys.argv[1], os.environ["RANK"]
    seen = {
        "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "name": __name__,
        "capability": torch.backends.cpu.get_cpu_capability(), "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")), "session_leader": os.getsid(0) == os.getpid(),
        "host": socket.gethostname(),
        "net": os.stat("/proc/self/ns/net").st_ino, "hosts": open("/etc/hosts").read(),
    }
    if rank == "0":  # torchrun ends it with SIGTERM once rank 1 has failed
        signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(out, "terminated"), "w").close(), os._exit(7)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"rank {rank} printed", flush=True)
    if rank == "0":
        time.sleep(120)
    waited = time.time()  # rank 0 may start seconds later on a loaded machine: it must have written before this fails
    while not os.path.exists(os.path.join(out, "rank0.json")) and time.time() - waited < 60:
        time.sleep(0.05)
    time.sleep(0.5)
    sys.exit(3)
    """
)
# What torchrun sets per run, and the server's address, which only the forked run has
PER_RUN = {
    "FORK_SERVER",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def _torchrun_probe(folder, forked: bool, prefix: list[str] = ()) -> tuple[int, str, list[dict], bool]:
    """A torchrun job of two probes (rank 1 exits 3, and torchrun stops rank 0): its exit code, output, what each
    rank saw, and whether rank 0 was told by SIGTERM."""
    folder.mkdir()
    script = folder / "probe.py"
    script.write_text(WORKER_PROBE)
    entry, env = zygote.torchrun_worker(script) if forked else ([str(script)], {})
    command = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0"]
    command += ["--monitor-interval=0.2", *entry, str(folder)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATEN_CPU_CAPABILITY="default", **env)
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    seen = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]
    return done.returncode, done.stdout + done.stderr, seen, (folder / "terminated").exists()


def _alike(seen: dict) -> dict:
    return {**seen, "env": {k: v for k, v in seen["env"].items() if k not in PER_RUN}}


def test_a_torchrun_worker_forked_from_the_server_is_what_torchrun_would_start(tmp_path):
    """torchrun's workers through ``bench/harness/forked.py`` see what torchrun's own workers see (environment,
    arguments, folder, kernels under ``ATEN_CPU_CAPABILITY=default``, one thread, a session of their own), their
    output reaches torchrun's, torchrun's SIGTERM reaches them, and torchrun reads their exit codes as its own."""
    fresh_code, fresh_out, fresh, fresh_told = _torchrun_probe(tmp_path / "fresh", forked=False)
    code, out, forked, told = _torchrun_probe(tmp_path / "forked", forked=True)
    assert code == fresh_code == 1 and told and fresh_told
    for output in (out, fresh_out):
        assert "rank 0 printed" in output and "rank 1 printed" in output
        assert "exitcode  : 3" in output and "local_rank: 1" in output
    for rank in range(2):
        assert forked[rank]["argv"] == [str(tmp_path / "forked")] and fresh[rank]["argv"] == [str(tmp_path / "fresh")]
        assert forked[rank]["env"]["RANK"] == str(rank)
        forked_rank, fresh_rank = _alike(forked[rank]), _alike(fresh[rank])
        forked_rank.pop("argv"), fresh_rank.pop("argv")
        assert forked_rank == fresh_rank
    assert forked[0]["capability"] == "DEFAULT" and forked[0]["native_threads"] == 1 and forked[0]["session_leader"]


def test_a_forked_worker_runs_in_its_hosts_namespaces(tmp_path):
    """Under ``ip netns exec`` on a named host (bench/harness/hosts.py) the forked worker sees the host's network, host
    name and ``/etc/hosts``, as the interpreter started there does."""
    from bench.harness.hosts import Hosts, namespaces_unavailable

    if why := namespaces_unavailable():
        pytest.skip(why)
    with Hosts(1, named=True) as (host,):
        prefix = [
            "ip",
            "netns",
            "exec",
            host.name,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {host.name} && exec "$@"',
        ]
        prefix.append("sh")
        _, _, fresh, _ = _torchrun_probe(tmp_path / "fresh", forked=False, prefix=prefix)
        _, _, forked, _ = _torchrun_probe(tmp_path / "forked", forked=True, prefix=prefix)
    own_net = os.stat("/proc/self/ns/net").st_ino
    for key in ("net", "host", "hosts"):
        assert forked[0][key] == fresh[0][key], key
    assert forked[0]["net"] != own_net and forked[0]["host"] == host.name and host.address in forked[0]["hosts"]


def test_a_killed_client_takes_its_worker_with_it(tmp_path):
    """torchrun's last resort is SIGKILL to the process it started, here the client: the server then kills the
    worker, which would otherwise live on outside torchrun's reach."""
    script = tmp_path / "sleeps.py"
    script.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    entry, env = zygote.torchrun_worker(script)
    pid_file = tmp_path / "pid"
    client = subprocess.Popen([sys.executable, "-u", *entry, str(pid_file)], env=dict(os.environ, **env), cwd=ROOT)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and client.poll() is None
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    assert worker != client.pid
    client.kill()
    client.wait(timeout=30)
    while Path(f"/proc/{worker}").exists():
        assert time.monotonic() < deadline + 30, "the worker outlived its client"
        time.sleep(0.05)
