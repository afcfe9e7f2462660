"""Does the planner pick right? Every candidate it ranks, run for real on 4 namespace hosts behind shaped links
(docs/planner.md).

    sudo python -m bench.planner [--models gpt mlp llama] [--rates 1000 100 20] [--steps 6] [--out DIR]
                                 [--no-doc] [--report]

Needs root (network namespaces, ``tc``; ``bench/harness/hosts.py``). Per model and link rate, one world of four
hosts of one rank (``bench/planner_worker.py``) calibrates (``transpiler calibrate``'s code, timed), plans
(timed), then runs every ranked candidate and reports its measured step time and memory. The scenarios are each
(model, rate) at two memory budgets per rank: unbounded, and tight (0.8 × the predicted peak of
``fused_allreduce``, which leaves out data parallelism and the DiLoCo family). Per scenario: the pick among the
candidates predicted to fit; the best measured among those measured to fit; the regret (measured time to the
target of the pick over the best's; time to the target is the step time × the steps factor, measured by
``bench/wan.py``, for the low-communication modes, and the step time for the others); the hand rule of the docs
(``streaming_diloco`` below 100 Mbit/s, else DDP's mode ``fused_allreduce`` where it fits, else ``zero3``) and its
regret. The llama (``TinyLlama`` with torchtitan's tensor-parallel plan) runs on one host of four ranks over
loopback instead (``torchrun``, no namespaces), where the plan also weighs tp = 2 and 4. ``--report`` writes the
tables and the figure again from ``--out``, running nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

from bench.harness.hosts import Hosts, launch_workers, namespaces_unavailable
from bench.models import NarrowGPT
from bench.planner_worker import factory, tp_plan_of
from bench.two_ranks import write_section
from transpiler.planner import plan, simple_cluster
from transpiler.planner.candidates import layouts
from transpiler.planner.cluster import Cluster, ComputeTimes
from transpiler.planner.costs import STEPS_FACTORS, estimate
from transpiler.planner.profile import StepProfile, profile_step

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "planner.md"
BEGIN, END = "<!-- planner:begin -->", "<!-- planner:end -->"
WORKER = ROOT / "bench" / "planner_worker.py"
UNBOUNDED = float("inf")


@functools.cache
def static_profile(model: str) -> StepProfile:
    """The bench model's profile traced here: its bytes do not depend on the run (its times are the run's)."""
    made, optimizer, loss_fn, make = factory(model)
    batch, tp_plan = make(torch.Generator(), 1), tp_plan_of(model, made)
    return profile_step(made, optimizer, loss_fn, batch, ComputeTimes(1.0, 1.0, 1.0), tp_plan=tp_plan)


def repriced(run: dict, model: str) -> list[dict]:
    """The run's rows with their predictions made again by the cost model as it is now, from the times and
    cluster the run measured and the bytes of the step traced now (with what the llama's plan splits and
    exchanges), so the tables always show the committed model's predictions."""
    if "profile" not in run:
        return run["rows"]
    saved, static = run["profile"], static_profile(model)
    profile = StepProfile(
        **{
            **saved,
            "tensor_parallel": static.tensor_parallel,
            "parameters": tuple(tuple(p) for p in saved["parameters"]),
            "compute": ComputeTimes(**saved["compute"]),
            "segment_seconds": tuple(saved.get("segment_seconds", ())),
            "segment_bytes": static.segment_bytes,
            "transient": static.transient,
            "recompute": static.recompute,
        }
    )
    cluster = Cluster.from_dict(run["cluster"])
    space = {layout.label: layout for layout in layouts(profile, cluster)[0]}
    rows = []
    for row in run["rows"]:
        e = estimate(space[row["label"]], profile, cluster, STEPS_FACTORS)
        rows.append(row | {"predicted_step": e.step, "predicted_peak": e.peak, "steps_factor": e.steps_factor})
    return rows


def to_target(row: dict, kind: str) -> float:
    return row[f"{kind}_step"] * row["steps_factor"]


def scenario(rows: list[dict], rate: float, budget: float) -> dict:
    """The pick, the best measured, the hand rule, and their regrets, at one memory budget."""
    ran = [r for r in rows if "error" not in r]
    predicted = [r for r in ran if r["predicted_peak"] <= budget]
    fits = [r for r in ran if r["measured_peak"] <= budget]
    pick = min(predicted, key=lambda r: to_target(r, "predicted"))
    best = min(fits, key=lambda r: to_target(r, "measured"))
    by_mode = {r["label"]: r for r in fits}
    rule = (
        by_mode.get("streaming_diloco")
        if rate < 100 and "streaming_diloco" in by_mode
        else by_mode.get("fused_allreduce") or by_mode.get("zero3")
    )
    fits_measured = pick["measured_peak"] <= budget
    return {
        "pick": pick,
        "best": best,
        "rule": rule,
        "regret": to_target(pick, "measured") / to_target(best, "measured") if fits_measured else None,
        "rule_regret": to_target(rule, "measured") / to_target(best, "measured") if rule else None,
        "error": pick["predicted_step"] / pick["measured_step"] - 1,
        "fits": fits_measured,
    }


def budgets_of(rows: list[dict]) -> dict[str, float]:
    fused = next(r for r in rows if r["label"] == "fused_allreduce")
    return {"unbounded": UNBOUNDED, "tight": 0.8 * fused["predicted_peak"]}


def tables(results: dict) -> str:
    """The scenario table and the summary (regrets, prediction errors, rank correlation, planning times)."""
    lines = [
        "| model | link | memory per rank | pick | predicted step | measured step | best measured | regret | hand rule "
        "(regret) |",
        "|---|---:|---|---|---:|---:|---|---:|---|",
    ]
    regrets, errors, pairs, rule_regrets, within = [], [], [], [], []
    for key, run in results.items():
        model, rate = key.split("@")
        link, rate = ("one host", float("inf")) if rate == "host" else (f"{float(rate):g} Mbit/s", float(rate))
        rows = repriced(run, model)
        ran = [r for r in rows if "error" not in r]
        pairs += [(to_target(r, "predicted"), to_target(r, "measured")) for r in ran]
        within.append(spearmanr([to_target(r, "predicted") for r in ran], [to_target(r, "measured") for r in ran]))
        for budget in budgets_of(rows).values():
            s = scenario(rows, rate, budget)
            regrets.append(s["regret"] if s["regret"] is not None else float("inf"))  # a pick over budget fails
            errors.append(s["error"])
            rule = f"{s['rule']['label']} ({s['rule_regret']:.2f})" if s["rule"] else "none fits"
            if s["rule_regret"]:
                rule_regrets.append(s["rule_regret"])
            memory = "unbounded" if budget == UNBOUNDED else f"{budget / 2**20:.1f} MiB"
            lines.append(
                f"| {model} | {link} | {memory} | {s['pick']['label']} | "
                f"{s['pick']['predicted_step'] * 1e3:.0f} ms | {s['pick']['measured_step'] * 1e3:.0f} ms"
                f"{'' if s['fits'] else ' (over budget)'} | {s['best']['label']} | "
                f"{'over budget' if s['regret'] is None else format(s['regret'], '.2f')} | {rule} |"
            )
    rho = spearmanr([p for p, _ in pairs], [m for _, m in pairs]).statistic
    plans = [run["planning_s"] for run in results.values()]
    calibrations = [run["calibration_s"] for run in results.values()]
    summary = [
        f"- Regret over {len(regrets)} scenarios: median **{statistics.median(regrets):.2f}**, worst "
        f"**{max(regrets):.2f}** (goals ≤ 1.05 and ≤ 1.15); the hand rule's: median "
        f"{statistics.median(rule_regrets):.2f}, worst {max(rule_regrets):.2f}.",
        f"- The pick's predicted step against its measured: {min(errors):+.0%} to {max(errors):+.0%} "
        "(goal within ±20%).",
        f"- Rank correlation (Spearman) of predicted and measured time to the target over all {len(pairs)} measured "
        f"candidates: **{rho:.2f}** (goal ≥ 0.8); within each (model, rate), "
        f"{min(c.statistic for c in within):.2f} to {max(c.statistic for c in within):.2f}.",
        f"- Planning {min(plans):.1f}–{max(plans):.1f} s, calibration {min(calibrations):.1f}–"
        f"{max(calibrations):.1f} s (W = 4, four ranks on this machine's cores).",
    ]
    return "\n".join([*summary, "", *lines]) + "\n"


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for key, run in results.items():
        ran = [r for r in repriced(run, key.split("@")[0]) if "error" not in r]
        ax.scatter([r["predicted_step"] * 1e3 for r in ran], [r["measured_step"] * 1e3 for r in ran], label=key, s=14)
    low, high = ax.get_xlim()
    ax.plot([low, high], [low, high], color="grey", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlabel="predicted step (ms)", ylabel="measured step (ms)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def one_host(steps: int, out: Path) -> dict:
    """The llama's world: four ranks of one host over loopback (tensor-parallel groups stay within a host), run by
    torchrun; its plan weighs tp = 2 and 4 with torchtitan's plan beside the rest."""
    began, part = time.monotonic(), out / "llama@host.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(WORKER)]
    command += ["--model", "llama"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(out / "llama@host.log", "w") as log:
        subprocess.run(
            [*command, "--steps", str(steps), "--out", str(part)],
            env=env,
            stdout=log,
            stderr=log,
            timeout=3600,
            check=True,
        )
    print(f"llama on one host took {time.monotonic() - began:.0f} s", flush=True)
    return json.loads(part.read_text())


def planning_time() -> str:
    """Plan a 110M-parameter GPT (12 blocks of width 768, vocab 16,384, 4 × 128 tokens per rank) for 4 hosts at
    100 Mbit/s, with the compute given as a calibration would give it: what planning costs after calibration."""
    torch.manual_seed(0)
    model = NarrowGPT(blocks=12, dim=768, heads=12, vocab=16384, seq=128)
    batch = (torch.randint(0, 16384, (4, 128)), torch.randint(0, 16384, (4 * 128,)))
    cluster = simple_cluster(4, 1, 100, 8192).with_compute(ComputeTimes(1.0, 2.0, 0.5, under_load=True))
    began = time.perf_counter()
    made = plan(model, torch.optim.AdamW(model.parameters()), torch.nn.CrossEntropyLoss(), batch, cluster)
    seconds = time.perf_counter() - began
    params = sum(p.numel() for p in model.parameters())
    return (
        f"Planning a {params / 1e6:.0f}M-parameter GPT (12 blocks of width 768, 4 × 128 tokens per rank) for 4 hosts "
        f"after calibration: **{seconds:.1f} s** on this machine (goal ≤ 30 s); the pick: {made.best.label}.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp", "llama"], choices=["gpt", "mlp", "llama"])
    parser.add_argument("--rates", type=float, nargs="+", default=[1000, 100, 20])
    parser.add_argument("--steps", type=int, default=6, help="at least this many timed steps per candidate")
    parser.add_argument(
        "--only",
        type=int,
        default=0,
        help="run only the first N ranked candidates (0: all); their rows replace those of --out's last run",
    )
    parser.add_argument("--out", default="/tmp/fx-transpiler-planner")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--report", action="store_true", help="no runs: the tables and figure from --out")
    parser.add_argument("--planning-time", action="store_true", help="only time a plan of a 110M-parameter GPT")
    args = parser.parse_args()
    if args.planning_time:
        print(planning_time())
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    if not args.report and "llama" in args.models:
        results["llama@host"] = one_host(args.steps, out)
        saved.write_text(json.dumps(results))
    if not args.report and set(args.models) - {"llama"}:
        why = namespaces_unavailable()
        if why:
            raise SystemExit(f"bench/planner.py needs network namespaces: {why}")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench/planner.py: terminated"))
        with Hosts(4) as hosts:
            port = 29400 + os.getpid() % 100
            for model in (m for m in args.models if m != "llama"):
                for rate in args.rates:
                    for host in hosts:
                        host.shape(rate)
                    began, port = time.monotonic(), port + 1
                    part = out / f"{model}@{rate:g}.json"
                    options = ["--model", model, "--steps", str(args.steps), "--out", str(part)]
                    launch_workers(
                        hosts, WORKER, options + ["--only", str(args.only)], out / f"{model}@{rate:g}", port, 3600
                    )
                    run, key = json.loads(part.read_text()), f"{model}@{rate:g}"
                    if args.only and key in results:  # a partial run's rows replace those of the same label
                        fresh = {r["label"]: r for r in run["rows"]}
                        run = results[key] | {"rows": [fresh.get(r["label"], r) for r in results[key]["rows"]]}
                    results[key] = run
                    saved.write_text(json.dumps(results))
                    print(f"{model} at {rate:g} Mbit/s took {time.monotonic() - began:.0f} s", flush=True)
    text = tables(results)
    print(text)
    if not args.no_doc:
        figure(results, DOC.parent / "planner_predicted.png")
        write_section(DOC, BEGIN, END, text)


if __name__ == "__main__":
    main()
