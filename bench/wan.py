"""Time, not bytes: the low-communication modes over shaped links, against DDP, DDP's PowerSGD and fp16 hooks and
torchft's own DiLoCo, to the same target loss (docs/strategies/low_communication.md).

    python -m bench.wan [--rates 1000 100 20] [--budget 70] [--ddp-steps 180] [--ddp-budget 240]
                        [--warmup-steps 600] [--hosts 4] [--variants LABEL ...] [--out DIR] [--no-doc] [--report]

Needs root (network namespaces, ``tc``) and ``pip install -e ".[bench]"`` (torchft, matplotlib). ``--hosts`` hosts
of one rank each (``bench/harness/hosts.py``), every host's link limited to each ``--rates`` rate in Mbit/s both ways
(``tbf``; no latency is added: this kernel has no ``netem``).
All ranks start from one warm start: the GPT of ``bench/diloco.py`` (1.8M parameters) trained by DDP for
``--warmup-steps`` steps on unshaped links, kept in ``--out`` for the next invocation. The inner lr is constant
(a run's course does not depend on how long it is let run). At each rate every variant trains for ``--budget``
seconds of its own steps (``bench/wan_worker.py`` says what the clock counts); DDP instead trains until
``--ddp-steps`` steps or ``--ddp-budget`` seconds. The target is DDP's held-out loss after ``--ddp-steps`` steps,
the same at every rate (DDP's arithmetic does not depend on the link); where DDP did not get there within its
budget, its time to it is ``--ddp-steps`` × its median step, marked as projected.

Reported per rate: the time to the target (and the steps), the held-out loss at the budget, compute utilisation
(steps × the median traced inner step of ``diloco H=50`` at the same rate, a step with no exchange, over the clock),
the bytes through each host's interface from its kernel counters against what the mode says it sent, and the largest
message; and, for the ``diloco H=15`` runs beside torchft's, every round rank by rank (the inner steps' CPU-seconds
and span, the cores kept busy, how far apart the ranks began and ended the sync, the exchange once all had begun it,
and each host's TCP retransmissions). Figures: held-out loss against time per rate, and a timeline of rank 0's steps
for Streaming DiLoCo at the lowest rate. ``--report`` writes the tables and figures again from ``--out``'s
``results.json`` (with the setting it was run with), running nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.harness.hosts import Hosts, launch_workers, namespaces_unavailable
from bench.two_ranks import write_section
from bench.wan_report import figures, tables
from bench.wan_worker import VARIANTS

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "strategies" / "low_communication.md"
BEGIN, END = "<!-- wan:begin -->", "<!-- wan:end -->"
WORKER = ROOT / "bench" / "wan_worker.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1000, 100, 20], help="Mbit/s, each way")
    parser.add_argument("--budget", type=float, default=70.0, help="seconds of steps per variant and rate")
    parser.add_argument("--ddp-steps", type=int, default=180, help="DDP's steps to the target (a multiple of 15)")
    parser.add_argument("--ddp-budget", type=float, default=240.0, help="DDP's own budget, seconds")
    parser.add_argument("--warmup-steps", type=int, default=600)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default="/tmp/fx-transpiler-wan", help="logs, results.json, the warm start")
    parser.add_argument("--no-doc", action="store_true", help="print the tables, leave the docs page as it is")
    parser.add_argument("--report", action="store_true", help="no runs: tables (and docs) from --out's results.json")
    args = parser.parse_args()
    setting = {"budget": args.budget, "ddp_steps": args.ddp_steps, "hosts": args.hosts, "warmup": args.warmup_steps}
    if args.report:  # the run's own setting, kept beside its results
        saved = json.loads((Path(args.out) / "results.json").read_text())
        report(saved["results"], saved["setting"], args.no_doc)
        return
    if args.variants[0] != "DDP":
        parser.error("the first variant must be DDP: its loss after --ddp-steps steps is every run's target")
    if args.ddp_steps % 15:
        parser.error("--ddp-steps must be a multiple of 15 (the weights are kept every 15 steps)")
    why = namespaces_unavailable()
    if why:
        raise SystemExit(f"bench/wan.py needs network namespaces: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = out / f"warm-{args.hosts}x{args.warmup_steps}.pt"
    results: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench/wan.py: terminated"))  # so the hosts are deleted
    with Hosts(args.hosts, named=True) as hosts:
        port = 29600 + os.getpid() % 200
        if not start.exists():
            print(f"warm start: {args.warmup_steps} DDP steps on unshaped links", flush=True)
            options = ["--warm", "--start", str(start), "--warmup-steps", str(args.warmup_steps)]
            launch_workers(hosts, WORKER, options, out / "warm", port, timeout=3600)
        for i, rate in enumerate(args.rates):
            for host in hosts:
                host.shape(rate)
            lines = out / f"rate{rate:g}.jsonl"
            lines.unlink(missing_ok=True)
            began = time.monotonic()
            print(f"{rate:g} Mbit/s: {', '.join(args.variants)}", flush=True)
            options = ["--out", str(lines), "--start", str(start), "--variants", *args.variants]
            options += ["--budget", str(args.budget), "--ddp-steps", str(args.ddp_steps)]
            options += ["--ddp-budget", str(args.ddp_budget)]
            timeout = args.ddp_budget + len(args.variants) * (args.budget + 120) + 300
            launch_workers(hosts, WORKER, options, out / f"rate{rate:g}", port + 1 + i, timeout)
            results += [json.loads(line) | {"rate": rate} for line in lines.read_text().splitlines()]
            print(f"{rate:g} Mbit/s took {time.monotonic() - began:.0f} s", flush=True)
    (out / "results.json").write_text(json.dumps({"setting": setting, "results": results}))
    report(results, setting, args.no_doc)


def report(results: list[dict], setting: dict, no_doc: bool) -> None:
    """Print the tables; unless ``no_doc``, write them and the figures into the docs page."""
    text = tables(results, setting)
    print(text)
    if no_doc:
        return
    figures(results, setting, DOC.parent)
    write_section(DOC, BEGIN, END, text)


if __name__ == "__main__":
    main()
