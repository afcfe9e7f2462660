"""Does Streaming DiLoCo's exchange overlap the inner steps? A profile of one fragment's sync at W=2 over gloo.

    python -m bench.diloco_overlap [--delays 0 1 2] [--trace DIR]

For each delay τ, ``streaming_diloco`` (P=2, H=8, float32 exchange) trains a GPT of 1.8M parameters on random
tokens, and torch.profiler records rank 0 from the step that starts fragment 0's exchange (``sync0``) to the step
that applies it. gloo runs the all-reduce on its own thread (the event ``gloo:all_reduce``), so the profile shows
when the bytes moved against the steps on the main thread. The table reports, per τ:

- the exchange: when gloo's work began and ended, from the start of the ``sync0`` step;
- how much of it ran while the main thread was inside a later step (overlapped with inner compute);
- the time the applying step spent in ``wait_tensor`` (blocked on the exchange).

With τ=0 the sync program waits for its own exchange; with τ ≥ 1 the exchange finishes during the next step and
the wait finds it done. ``--trace DIR`` also writes each profile as a Chrome trace (open it in Perfetto).
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.models import NarrowGPT
from bench.two_ranks import two_rank_results, write_section
from transpiler import mode_config, transpile

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "strategies" / "diloco.md"
BEGIN, END = "<!-- diloco-overlap:begin -->", "<!-- diloco-overlap:end -->"
SYNC_EVERY, FRAGMENTS, VOCAB, SEQ, BATCH = 8, 2, 64, 64, 8


def batches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        yield x, torch.randint(0, VOCAB, (BATCH * SEQ,), generator=gen)


def profile(delay: int, trace: str | None) -> dict:
    """Run to fragment 0's second sync (the first one warms up), profile it until its apply, and summarise."""
    torch.manual_seed(0)
    model = NarrowGPT(blocks=4, dim=192, heads=4, vocab=VOCAB, seq=SEQ)
    options = {"sync_every": SYNC_EVERY, "fragments": FRAGMENTS, "fragment_sync_delay": delay}
    step = transpile(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        mode_config("streaming_diloco", **options),
        loss_fn=torch.nn.CrossEntropyLoss(),
    )
    data = batches(dist.get_rank())
    start_at = SYNC_EVERY // FRAGMENTS + SYNC_EVERY  # fragment 0's second exchange starts at this step
    for _ in range(start_at - 1):
        step(*next(data))
    variants = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(delay + 1):
            with torch.profiler.record_function("transpiler step"):
                step(*next(data))
            variants.append(step.last_variant)
    if trace and dist.get_rank() == 0:
        prof.export_chrome_trace(str(Path(trace) / f"streaming_tau{delay}.json"))
    events = list(prof.events())
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "transpiler step")
    gloo = [e for e in events if e.name.startswith("gloo:")]
    waits = [e for e in events if e.name == "_c10d_functional::wait_tensor"]
    begin, end = min(e.time_range.start for e in gloo), max(e.time_range.end for e in gloo)
    later = sum(max(0, min(end, e) - max(begin, s)) for s, e in spans[1:])  # inside a step after sync0
    last = spans[-1]
    waited = sum(e.time_range.end - e.time_range.start for e in waits if last[0] <= e.time_range.start <= last[1])
    us = 1e-3  # profiler times are in microseconds: to milliseconds
    return {
        "delay": delay,
        "variants": variants,
        "exchange_bytes": sum(
            n.meta["collective"]["bytes"] for n in step.programs["sync0"].graph.nodes if "collective" in n.meta
        ),
        "exchange_ms": (begin - spans[0][0]) * us,
        "exchange_end_ms": (end - spans[0][0]) * us,
        "overlapped_ms": later * us,
        "exchange_len_ms": (end - begin) * us,
        "wait_ms": waited * us,
        "steps_ms": [(e - s) * us for s, e in spans],
    }


def worker(out: str, delays: list[int], trace: str | None) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    results = [profile(delay, trace) for delay in delays]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def table(results: list[dict]) -> str:
    lines = [
        f"W=2 over gloo on {platform.machine()}, streaming_diloco P={FRAGMENTS}, H={SYNC_EVERY}, float32 exchange of "
        f"{results[0]['exchange_bytes'] / 2**20:.1f} MiB (fragment 0), rank 0, one profile per τ "
        "(`python -m bench.diloco_overlap`):",
        "",
        "| τ | steps profiled | exchange on gloo's thread (from the sync step's start) | of it inside later steps "
        "| wait in the applying step | step times |",
        "|---:|---|---|---:|---:|---|",
    ]
    for r in results:
        steps = ", ".join(f"{t:.0f}" for t in r["steps_ms"])
        lines.append(
            f"| {r['delay']} | {' → '.join(r['variants'])} | {r['exchange_ms']:.1f} – {r['exchange_end_ms']:.1f} ms "
            f"| {r['overlapped_ms']:.1f} of {r['exchange_len_ms']:.1f} ms | {r['wait_ms']:.2f} ms | {steps} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trace", help="write each profile as a Chrome trace into this folder")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.delays, args.trace)
        return
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    trace = ["--trace", str(Path(args.trace).resolve())] if args.trace else []
    results = two_rank_results(
        __file__, lambda out, tmp: ["--worker", out, "--delays", *map(str, args.delays), *trace], port=29573
    )
    text = table(results)
    print(text)
    write_section(DOC, BEGIN, END, text)


if __name__ == "__main__":
    main()
