"""What a lost worker costs: replica groups under a torchft quorum against torchrun's elastic restart.

The same job both ways, the digits example (``examples/train_digits.py``, fused_allreduce, Adam, ``B`` samples per
worker and step) with ``G`` workers on this machine:

- **quorum**: a lighthouse (``torchft_lighthouse``, heartbeat timeout 2 s) and ``G`` replica groups, each a torchrun
  job of one process (``--fault-tolerance --min-replicas G-1``, ``--max-restarts`` high);
- **elastic**: one torchrun job of ``G`` processes, checkpointing every ``--save-every`` steps
  (``--checkpoint-dir``), which torchrun restarts as a whole after a failure.

Each runs ``--duration`` seconds without faults, then as long with one worker SIGKILLed every ``--kill-every``
seconds (the groups in turn; torchrun restarts it). From the workers' sample logs (``--log-samples``) it reports
committed samples per second (a quorum's uncommitted steps and the elastic path's redone steps do not count),
their ratio to the same path without faults, the seconds each fault cost the survivors (the longest gap between
steps that count, from the one the fault falls in to 20 s after it, less the median gap; a step that was under
way when the worker died may still commit), the steps redone or not committed, and the restarts of workers
that were not killed (worker processes seen, less the first and the killed).

``python -m bench.fault_tolerance`` (about 12 minutes) writes the table into ``docs/fault_tolerance.md``;
``--duration 180 --kill-every 45`` is issue 65's setting. Besides the two paths it runs the same job with no quorum
and no checkpoints (the step a quorum is measured against), and the quorum taken beside the step
(``--async-quorum``) and every ``QUORUM_EVERY`` steps (``--quorum-every``). The peer (issue 77): the same job as
torchft's users write it, its ``Manager`` with its DDP wrapper (``bench/torchft_ddp_worker.py``), with torchft's
default asynchronous quorum and with a synchronous one. ``--fault-free`` runs each path without faults only;
``--hidden`` widens the MLP on every path for a longer step (docs/fault_tolerance.md: ``--batch 320 --hidden 1024``,
about 41 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.launch import free_port
from bench.two_ranks import write_section

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_digits.py"
PEER = ROOT / "bench" / "torchft_ddp_worker.py"  # torchft's own Manager + DDP wrapper on the same job
DOC = ROOT / "docs" / "fault_tolerance.md"
BEGIN, END = "<!-- fault_tolerance:begin -->", "<!-- fault_tolerance:end -->"
HEARTBEAT_MS = 2000
QUORUM_EVERY = 10


def _env(**extra: str) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        RUST_LOG="warn",
        **extra,
    )


def _torchrun(nproc: int, args: list[str], env: dict[str, str], log: Path, script: Path = EXAMPLE) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--max-restarts=1000",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=bench{free_port()}",
        "--monitor-interval=0.5",
        str(script),
        *args,
    ]
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)


def _records(logs: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(logs.glob("*.jsonl")):
        lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
        out[path.stem] = [json.loads(line) for line in lines]
    return out


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a torchrun agent's workers), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return sorted(out)


def _kill_one(agents: list[subprocess.Popen], turn: int) -> float | None:
    """SIGKILL one live worker, the ``turn``-th in order (the groups in turn; the ranks of one job in turn); the
    time, or None while no worker is up (a restart under way: the caller tries again)."""
    workers = [w for agent in agents for w in _children(agent.pid)]
    if not workers:
        return None
    try:
        os.kill(workers[turn % len(workers)], signal.SIGKILL)
    except ProcessLookupError:
        return None
    return time.time()


# the quorum's paths: the example's options for each
QUORUM_PATHS = {
    "quorum": [],
    "quorum, async": ["--async-quorum"],
    f"quorum every {QUORUM_EVERY}": ["--quorum-every", str(QUORUM_EVERY)],
}
# the peer's paths (bench/torchft_ddp_worker.py): torchft's default, the quorum beside the step, and before it
PEER_PATHS = {
    "torchft Manager + DDP": [],
    "torchft Manager + DDP, sync quorum": ["--sync-quorum"],
}


def _under_quorum(path: str) -> bool:
    """Whether ``path``'s workers are replica groups under a lighthouse (ours or torchft's own loop)."""
    return path in QUORUM_PATHS or path in PEER_PATHS


def run(
    path: str, groups: int, batch: int, duration: float, kill_every: float | None, save_every: int, hidden: int = 128
) -> dict:
    """One run of ``path`` (one of :data:`QUORUM_PATHS` or :data:`PEER_PATHS`, "elastic", or "no quorum": the
    elastic job without checkpoints, never faulted), with or without faults: its log records and kill times."""
    work = Path(tempfile.mkdtemp(prefix=f"ft_{path.replace(' ', '_').replace(',', '')}_"))
    logs = work / "samples"
    shared = ["--log-samples", str(logs), "--timeout", "30", "--hidden", str(hidden)]  # the example's and the peer's
    common = ["--mode", "fused_allreduce", "--epochs", "100000", *shared]
    jobs: list[subprocess.Popen] = []
    if _under_quorum(path):
        port = free_port()
        lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", str(groups - 1)]
        lighthouse += ["--bind", f"[::]:{port}", "--heartbeat_timeout_ms", str(HEARTBEAT_MS)]
        lighthouse += ["--join_timeout_ms", "1000"]
        jobs.append(
            subprocess.Popen(
                lighthouse,
                env=_env(),
                stdout=(work / "lighthouse.log").open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        quorum = ["--min-replicas", str(groups - 1), "--global-batch", str(batch)]
        if path in PEER_PATHS:
            script, args = PEER, [*shared, *quorum, *PEER_PATHS[path]]
        else:
            script, args = EXAMPLE, [*common, "--fault-tolerance", *quorum, *QUORUM_PATHS[path]]
        for g in range(groups):
            env = _env(TORCHFT_LIGHTHOUSE=f"http://localhost:{port}", REPLICA_GROUP_ID=f"g{g}")
            jobs.append(_torchrun(1, args, env, work / f"g{g}.log", script))
    else:
        args = [*common, "--global-batch", str(batch * groups)]
        if path == "elastic":
            args += ["--checkpoint-dir", str(work / "checkpoints"), "--save-every", str(save_every)]
        jobs.append(_torchrun(groups, args, _env(), work / "elastic.log"))
    kills: list[float] = []
    try:
        deadline = time.time() + 240
        while len(_records(logs)) < groups if logs.exists() else True:  # every worker stepped once
            if time.time() > deadline:
                raise RuntimeError(f"the {path} job did not start: see {work}")
            time.sleep(0.2)
        start = time.time()
        next_kill = start + kill_every if kill_every else float("inf")
        agents = jobs[1:] if _under_quorum(path) else jobs
        seen = {w for agent in agents for w in _children(agent.pid)}  # every worker process the run started
        first = len(seen)
        while time.time() < start + duration:
            seen |= {w for agent in agents for w in _children(agent.pid)}
            if time.time() >= next_kill:
                killed = _kill_one(agents, len(kills))
                if killed is not None:
                    kills.append(killed)
                    next_kill += kill_every
            time.sleep(0.2)  # the /proc scans of this loop cost CPU the workers share
        end = time.time()
    finally:  # the workers first: torchrun starts each in a session of its own, which killpg would miss
        for job in jobs:
            for pid in [*_children(job.pid), job.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            job.wait()
    records = _records(logs)
    return {
        "records": records,
        "start": start,
        "end": end,
        "kills": kills,
        "starts": len(seen) - first,
        "work": str(work),
    }


def committed_steps(path: str, records: dict[str, list[dict]], start: float, end: float) -> list[tuple[float, int]]:
    """(time, samples) of each step that counts, inside [start, end]: under a quorum each committed step, as
    its participants logged it; elastic, each step number as its last attempt ran it (an earlier attempt's steps
    after the checkpoint it resumed from were redone)."""
    if _under_quorum(path):
        steps: dict[int, list[dict]] = {}
        for log in records.values():
            for r in log:
                if r["committed"]:
                    steps.setdefault(r["step"], []).append(r)
        return sorted(
            (max(r["time"] for r in rs), sum(len(r["ids"]) for r in rs))
            for rs in steps.values()
            if start <= max(r["time"] for r in rs) <= end
        )
    last: dict[int, dict[int, dict]] = {}
    for log in records.values():
        for r in log:
            by_attempt = last.setdefault(r["step"], {})
            by_attempt.setdefault(r["attempt"], {})[r["rank"]] = r
    out = []
    for attempts in last.values():
        final = attempts[max(attempts)]
        t = max(r["time"] for r in final.values())
        if start <= t <= end:
            out.append((t, sum(len(r["ids"]) for r in final.values())))
    return sorted(out)


def summary(path: str, result: dict) -> dict:
    records, start, end, kills = result["records"], result["start"], result["end"], result["kills"]
    steps = committed_steps(path, records, start, end)
    samples = sum(n for _, n in steps)
    times = [t for t, _ in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    usual = statistics.median(gaps) if gaps else 0.0
    costs = []  # the longest gap between steps that count, from the one a fault falls in to 20 s after it
    for kill in kills:
        window = [b - a for a, b in zip([start, *times], [*times, end]) if b > kill and a < kill + 20]
        costs.append(max(window) - usual)
    all_records = [r for log in records.values() for r in log if start <= r["time"] <= end]
    if _under_quorum(path):  # each group's uncommitted steps
        wasted = sum(1 for r in all_records if not r["committed"])
    else:  # the steps each rank ran more than once
        wasted = max(0, len(all_records) // max(1, len(records)) - len(steps))
    return {
        "samples_per_s": samples / (end - start),
        "fault_costs": costs,
        "wasted_steps": wasted,
        "survivor_restarts": max(0, result["starts"] - len(kills)),  # restarts of workers that were not killed
        "kills": len(kills),
        "step_ms": usual * 1000,
        "mean_step_ms": (end - start) / max(len(steps), 1) * 1000,
    }


def table(results: dict[tuple[str, bool], dict], args: argparse.Namespace) -> str:
    rows = [
        f"{args.groups} workers, {args.batch} samples each per step, {args.duration:.0f} s per run, one worker killed "
        f"every {args.kill_every:.0f} s in the faulty runs; elastic checkpoints every {args.save_every} steps. "
        "Quorum: lighthouse heartbeat timeout 2 s. *Step ms*: the run's time per committed step; *× no quorum*: "
        "that against the same job without a quorum or checkpoints. *s lost per fault*: the fault-free run's "
        "seconds of training each fault cost (from the two rates); *at 1 fault / 3 h*: the fault-free rate less that "
        "loss once every 3 hours (projected).\n",
        "| path | faults | committed samples/s | vs fault-free | step ms | × no quorum | s each fault cost the "
        "survivors (median, max) | s lost per fault | at 1 fault / 3 h | steps not committed or redone | restarts of "
        "workers not killed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bare = results.get(("no quorum", False))
    for (path, faulty), s in results.items():
        fault_free = results[(path, False)]
        rows.append(_row(path, s, fault_free, bare, args.duration, faulty))
    return "\n".join(rows) + "\n"


def _row(path: str, s: dict, fault_free: dict, bare: dict | None, duration: float, faulty: bool) -> str:
    costs = s["fault_costs"]
    cost = f"{statistics.median(costs):.2f}, {max(costs):.2f}" if costs else "–"
    ratio = s["samples_per_s"] / fault_free["samples_per_s"]
    lost = (1 - ratio) * duration / s["kills"] if faulty and s["kills"] else None
    three_hours = fault_free["samples_per_s"] * (1 - lost / 10800) if lost is not None else None
    versus = f"{s['mean_step_ms'] / bare['mean_step_ms']:.2f}" if bare is not None and not faulty else "–"
    cells = [path, s["kills"], f"{s['samples_per_s']:.0f}", f"{ratio:.2f}", f"{s['mean_step_ms']:.1f}", versus]
    cells += [cost, f"{lost:.1f}" if lost is not None else "–", f"{three_hours:.0f}" if three_hours else "–"]
    cells += [s["wasted_steps"], s["survivor_restarts"]]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=15.0)
    parser.add_argument("--save-every", type=int, default=50, help="the elastic path's checkpoint interval (steps)")
    parser.add_argument("--hidden", type=int, default=128, help="the MLP's first hidden width: a longer step")
    parser.add_argument("--no-doc", action="store_true", help="print the table only")
    parser.add_argument("--fault-free", action="store_true", help="run each path without faults only")
    paths = ["no quorum", *QUORUM_PATHS, "elastic", *PEER_PATHS]
    parser.add_argument("--paths", nargs="+", choices=paths, default=paths, help="which paths to run, in order")
    args = parser.parse_args()
    results = {}
    for path in args.paths:
        for faulty in (False, True) if path != "no quorum" and not args.fault_free else (False,):
            result = run(
                path,
                args.groups,
                args.batch,
                args.duration,
                args.kill_every if faulty else None,
                args.save_every,
                args.hidden,
            )
            results[(path, faulty)] = summary(path, result)
            print(path, "faults" if faulty else "fault-free", results[(path, faulty)], result["work"], flush=True)
    body = table(results, args)
    print(body)
    if not args.no_doc:
        command = "python -m bench.fault_tolerance"
        write_section(DOC, BEGIN, END, f"`{command}` (this machine, 2 cores):\n\n{body}")


if __name__ == "__main__":
    main()
