"""The tables and figures of ``bench/wan.py``, from its workers' results (one dict per variant and rate)."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

MIB = 2**20
REFERENCE = ("diloco H=50", "diloco H=15")  # whose inner step (no exchange) is the compute a step needs
TIMELINE = ("streaming int4 tau=1", "streaming int4 tau=0")


def target_loss(results: list[dict], ddp_steps: int) -> float:
    """DDP's held-out loss after ``ddp_steps`` steps (the same at every rate: its arithmetic ignores the link)."""
    for r in results:
        if r["label"] == "DDP":
            for step, _, loss in r["series"]:
                if step == ddp_steps:
                    return loss
    raise SystemExit(f"no DDP run reached {ddp_steps} steps: raise --ddp-budget")


def time_to(r: dict, target: float, ddp_steps: int) -> tuple[float | None, int | None, bool]:
    """When ``r`` first held the target: seconds, steps, and whether it is projected (DDP short of its steps)."""
    for step, clock, loss in r["series"]:
        if (r["label"] == "DDP" and step == ddp_steps) or (r["label"] != "DDP" and loss <= target):
            return clock, step, False
    if r["label"] == "DDP":
        return (ddp_steps - 1) * r["step_ms"] / 1000, ddp_steps, True
    return None, None, False


def compute_ms(rows: list[dict]) -> float | None:
    """The median traced step with no exchange at this rate: ``diloco``'s inner step."""
    for label in REFERENCE:
        for r in rows:
            if r["label"] == label:
                return r["program_ms"]["inner"]
    return None


def loss_at(r: dict, budget: float) -> str:
    """The held-out loss of the last weights kept within the budget ("–": none was)."""
    within = [loss for _, clock, loss in r["series"] if clock <= budget]
    return f"{within[-1]:.4f}" if within else f"– (first at {r['series'][0][1]:.0f} s)"


def tables(results: list[dict], setting: dict) -> str:
    target = target_loss(results, setting["ddp_steps"])
    world = setting["hosts"]
    params = results[0]["params"]
    ddp_bytes = 2 * (world - 1) / world * 4 * params
    lines = [
        f"{world} hosts of one rank (network namespaces on one {platform.processor() or platform.machine()} machine, "
        f"{os.cpu_count()} cores), GPT of {params:,} parameters from {setting['warmup']} DDP steps, constant inner "
        f"lr. Target: DDP's held-out loss after {setting['ddp_steps']} steps, **{target:.4f}**. Budget: "
        f"{setting['budget']:.0f} s of steps per run. DDP's ring all-reduce sends {ddp_bytes / MIB:.1f} MiB per rank "
        "per step.",
        "",
    ]
    for rate in dict.fromkeys(r["rate"] for r in results):
        rows = [r for r in results if r["rate"] == rate]
        ddp = next(r for r in rows if r["label"] == "DDP")
        ddp_time = time_to(ddp, target, setting["ddp_steps"])[0]
        compute = compute_ms(rows)
        comm = ddp_bytes * 8 / (rate * 1e6)
        ratio = f", communication/compute **{1000 * comm / compute:.1f}**" if compute else ""
        lines += [
            f"**{rate:g} Mbit/s each way per host.** DDP's exchange at this rate: {1000 * comm:.0f} ms a step at "
            f"least, against {compute or float('nan'):.0f} ms of compute{ratio}.",
            "",
            "| run | time to target | × DDP's | steps | loss at budget | compute utilisation | link tx per rank "
            "| mode says | link/mode | peak message | median step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            seconds, steps, projected = time_to(r, target, setting["ddp_steps"])
            if seconds is None:
                reach, times, steps_cell = f"missed ({r['series'][-1][2]:.4f})", "–", f"{r['steps']}"
            else:
                reach = f"{'≈' if projected else ''}{seconds:.0f} s" + (" (projected)" if projected else "")
                times, steps_cell = f"{seconds / ddp_time:.2f}", f"{steps}"
            clock = r["series"][-1][1]
            timed = r["series"][-1][0] - r["untimed"]
            utilisation = f"{100 * timed * compute / 1000 / clock:.0f}%" if compute else "–"
            tx, said = sum(r["link_tx"]) / world, sum(r["mode_sent"]) / world
            lines.append(
                f"| {r['label']} | {reach} | {times} | {steps_cell} | {loss_at(r, setting['budget'])} "
                f"| {utilisation} | {tx / MIB:,.2f} MiB | {said / MIB:,.2f} MiB | {tx / max(said, 1):.3f} "
                f"| {r['peak_message'] / 1024:,.0f} KiB | {r['step_ms']:.0f} ms |"
            )
        lines.append("")
    lines += against_torchft(results)
    lines += rank_table(results)
    lines += timeline_table(results)
    return "\n".join(lines)


def against_torchft(results: list[dict]) -> list[str]:
    """This project's ``diloco H=15`` runs against torchft's DiLoCo at the same H: steps per second of the clock,
    and how far apart the held-out losses are at the steps both kept (at W=2 they are equal; at W=4 gloo sums one
    bucket here and each tensor alone there, in other orders)."""
    lines = [
        "`diloco H=15` against torchft's DiLoCo H=15 (the same algorithm, start and data):",
        "",
        "| rate | run | ours: steps/s | torchft: steps/s | ours / torchft | sync (ours / torchft) | held-out losses "
        "at the same steps |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for rate in dict.fromkeys(r["rate"] for r in results):
        rows = {r["label"]: r for r in results if r["rate"] == rate}
        theirs = rows.get("torchft DiLoCo H=15")
        for label, ours in rows.items():
            if theirs is not None and label.startswith("diloco H=15"):
                lines.append(beside_torchft(rate, ours, theirs))
    return [*lines, ""] if len(lines) > 4 else []


def beside_torchft(rate: float, ours: dict, theirs: dict) -> str:
    """One row of ``against_torchft``."""
    speed = [(r["series"][-1][0] - r["untimed"]) / r["series"][-1][1] for r in (ours, theirs)]
    common = min(len(ours["series"]), len(theirs["series"]))
    apart = max(abs(a[2] / b[2] - 1) for a, b in zip(ours["series"][:common], theirs["series"][:common]))
    return (
        f"| {rate:g} Mbit/s | {ours['label']} | {speed[0]:.2f} | {speed[1]:.2f} | {speed[0] / speed[1]:.2f} "
        f"| {ours['program_ms']['sync']:.0f} / {theirs['program_ms']['sync']:.0f} ms "
        f"| {common} kept by both, at most {apart:.1e} apart (relative) |"
    )


def rounds(ranks: list[list]) -> list[dict[str, float]]:
    """Each DiLoCo round of every rank's steps (``ranks``: per rank, (begin, wall s, CPU s, program) per step,
    the same programs at the same positions): the inner steps' CPU-seconds over all ranks and their span on the
    machine's clock, from the first rank's first to the last rank's last; how far apart the ranks began the sync;
    how long the exchange took after the last rank began it (the median rank's end), and how far apart the ranks
    ended it."""
    syncs = [i for i, step in enumerate(ranks[0]) if step[3] == "sync"]
    out = []
    for before, at in zip([-1, *syncs], syncs):
        inner = range(before + 1, at)
        if not inner:
            continue
        first = min(steps[inner[0]][0] for steps in ranks)
        last = max(steps[inner[-1]][0] + steps[inner[-1]][1] for steps in ranks)
        arrivals = [steps[at][0] for steps in ranks]
        ends = sorted(steps[at][0] + steps[at][1] for steps in ranks)
        cpu = sum(steps[i][2] for steps in ranks for i in inner)
        out.append(
            {
                "cpu": cpu,
                "span": last - first,
                "busy": cpu / (last - first),
                "spread": max(arrivals) - min(arrivals),
                "exchange": ends[len(ends) // 2] - max(arrivals),
                "ends": ends[-1] - ends[0],
            }
        )
    return out


def rank_table(results: list[dict]) -> list[str]:
    """``diloco H=15`` and torchft's DiLoCo rank by rank: per round, what the inner steps cost in CPU-seconds (over
    all ranks) and on the clock, how many cores that kept busy, how far apart the ranks reached the sync, and how
    long the exchange took once all had."""
    rows = [r for r in results if r["label"].startswith(("diloco H=15", "torchft DiLoCo H=15")) and r.get("ranks")]
    if not rows:
        return []
    lines = [
        f"Rank by rank (every rank's steps on the machine's clock; medians over rounds; {os.cpu_count()} cores): "
        "the inner steps' CPU-seconds over all ranks, their span from the first rank's first to the last rank's "
        "last, the cores they kept busy (CPU over span), how far apart the ranks began the sync, the exchange from "
        "the last rank's start to the median rank's end, how far apart the ranks ended it, and the TCP segments "
        "each host sent again over the run (a shaped link's full queue drops them):",
        "",
        "| rate | run | rounds | inner CPU-s | inner span | busy cores | starts apart | exchange | ends apart "
        "| resent per host |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        each = rounds(r["ranks"])
        if not each:
            continue
        m = {key: statistics.median(x[key] for x in each) for key in each[0]}
        resent = r.get("retransmitted", [])
        lines.append(
            f"| {r['rate']:g} Mbit/s | {r['label']} | {len(each)} | {m['cpu']:.2f} s | {m['span']:.2f} s "
            f"| {m['busy']:.2f} | {1000 * m['spread']:.0f} ms | {m['exchange']:.2f} s "
            f"| {1000 * m['ends']:.0f} ms | {sum(resent) / max(len(resent), 1):,.0f} |"
        )
    return [*lines, ""]


def timeline_table(results: list[dict]) -> list[str]:
    """Where Streaming DiLoCo's time goes at the lowest rate: per program, steps, median and total time."""
    lowest = min(r["rate"] for r in results)
    rows = [r for r in results if r["rate"] == lowest and r["label"] in TIMELINE]
    if not rows:
        return []
    lines = [
        f"Where Streaming DiLoCo's time goes at {lowest:g} Mbit/s (rank 0, every step of the run):",
        "",
        "| run | program | steps | median | total | bytes sent during these steps (tx counter) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        for program in sorted({p for _, _, p, _ in r["timeline"]}):
            took = sorted(t for _, t, p, _ in r["timeline"] if p == program)
            sent = sum(b for _, _, p, b in r["timeline"] if p == program)
            lines.append(
                f"| {r['label']} | {program} | {len(took)} | {1000 * took[len(took) // 2]:.0f} ms "
                f"| {sum(took):.1f} s | {sent / MIB:.2f} MiB |"
            )
    return [*lines, ""]


def figures(results: list[dict], setting: dict, folder: Path) -> None:
    """Held-out loss against time, one figure per rate; rank 0's timeline of Streaming DiLoCo at the lowest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = target_loss(results, setting["ddp_steps"])
    for rate in dict.fromkeys(r["rate"] for r in results):
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in (r for r in results if r["rate"] == rate):
            clocks, losses = [c for _, c, _ in r["series"]], [loss for _, _, loss in r["series"]]
            ax.plot(clocks, losses, label=r["label"], marker="." if len(clocks) < 8 else None)
        ax.axhline(target, color="black", linestyle=":", label=f"target (DDP, {setting['ddp_steps']} steps)")
        ax.set(xlabel="seconds of steps", ylabel="held-out loss", title=f"{rate:g} Mbit/s each way per host")
        ax.set_xlim(0, setting["budget"] * 1.5)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / f"low_communication_{rate:g}mbit.png", dpi=90)
        plt.close(fig)
    lowest = min(r["rate"] for r in results)
    rows = [r for r in results if r["rate"] == lowest and r["label"] in TIMELINE]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.6 * len(rows)), sharex=True)
    colours = {"inner": "tab:blue", "sync": "tab:orange", "apply": "tab:red"}
    for ax, r in zip(axes if len(rows) > 1 else [axes], rows):
        window = r["timeline"][100:160] if len(r["timeline"]) >= 160 else r["timeline"]  # 60 steps, past the start
        for clock, took, program, _ in window:
            ax.broken_barh([(clock, took)], (0, 1), color=colours.get(program, "grey"))
        sent = ax.twinx()
        sent.step([e[0] + e[1] for e in window], [e[3] / 1024 for e in window], where="pre", color="black")
        sent.set_ylabel("KiB sent in the step")
        ax.set(yticks=[], title=f"{r['label']}, {lowest:g} Mbit/s: rank 0's steps (blue inner, orange sync, red apply)")
    axes_list = axes if len(rows) > 1 else [axes]
    axes_list[-1].set_xlabel("seconds of steps")
    fig.tight_layout()
    fig.savefig(folder / "low_communication_timeline.png", dpi=90)
    plt.close(fig)
