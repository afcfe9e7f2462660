"""Does DiLoCo train? A character-level GPT on Python's own documentation, at W=4 over gloo, every strategy for the
same number of tokens: DDP, ``local_sgd`` with k=H, ``diloco`` with H = 10, 15, 50 and 100, ``streaming_diloco``
with a 4-bit exchange, ``sparseloco`` (H = 15, 30 and 50, 64 or 128 of each 64 × 64 tile, 2-bit values) and
``demo`` (32 or 64 DCT coefficients of each 64 × 64 tile) (docs/strategies/diloco.md, sparseloco.md, demo.md).

    python -m bench.diloco [--warmup-steps 600] [--schedule cosine|constant] [--steps 600] [--world 4] [--seed 0]
                           [--model narrow|wide] [--runs LABEL ...]

The corpus is ``pydoc_data.topics`` (the text of ``help()``, about 465k characters, shipped with CPython): no
download. The last tenth is held out. Each rank draws its own windows of the first nine tenths. Every run starts from
the same weights, with AdamW inside (lr 1e-3, weight decay 0.1); the DiLoCo runs take the paper's outer Nesterov SGD
(lr 0.7, momentum 0.9), SparseLoCo its authors' published settings (α = 1, β = 0.95, tiles of 64 × 64, 4 bins over
6σ), and DeMo plain SGD on its sign steps (lr 1e-3, β = 0.999, its own decoupled weight decay 0.1), as its authors.
With ``--warmup-steps N`` those weights are first trained by DDP for N steps, once, as the paper starts DiLoCo from a
pretrained model (its runs start at 24k of 88k steps); every run then starts from them with a fresh AdamW. The inner
lr follows ``--schedule``: a cosine from 1e-3 down to 1e-4 over the run (the default; the paper's inner schedule after
its warm-up), or constant; DDP takes the same. The tables of seed 0 go into the docs page (``diloco-warm`` with
warm-up steps, ``diloco-cold`` without, ``-wide`` for ``--model wide``); another ``--seed``, or a choice of
``--runs``, only prints its table. The loss reported is the held-out loss of the weights the paper evaluates: the
global weights for DiLoCo (``step.global_weights()``), the model for the others, after the last step.

Bytes are what one rank sends, counted from the buffers each program hands its collectives (B bytes each): a ring
all-reduce sends ``2 (W-1)/W B``, an all-to-all ``(W-1)/W B``, an all-gather ``(W-1) B`` (the rank's message to each
of the others; until issue 64 this counted ``(W-1)/W B``, W times too few, which the link counters of
``bench/wan.py`` showed); DDP all-reduces every gradient every step. The peak message is the largest buffer a rank
hands one collective. Step time is the median over the run's
steps, the slower rank's, syncs included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.models import NarrowGPT
from bench.two_ranks import write_section
from transpiler import Clipping, mode_config, transpile
from transpiler.graph.edit import node_bytes

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "strategies" / "diloco.md"
BEGIN, END = "<!-- diloco:begin -->", "<!-- diloco:end -->"  # diloco-cold / diloco-warm in the page
SEQ, PER_RANK, EVAL_BATCHES = 64, 8, 16
LR, FLOOR = 1e-3, 0.1  # the inner AdamW's lr, and where the cosine schedule ends (a share of LR)
DEMO_LR = 1e-3  # DeMo's SGD on sign steps: each element moves by the lr, as AdamW's steps roughly do
CLIP = Clipping(max_norm=1.0)  # the authors' DiLoCo loop clips each inner step's gradients to norm 1
STREAMING = {"sync_every": 50, "fragments": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
RUNS = {  # label -> (mode, options)
    "DDP": ("ddp", {}),
    "local_sgd k=50": ("local_sgd", {"k_steps": 50, "begin_step": 0}),
    "diloco H=10": ("diloco", {"sync_every": 10}),
    "diloco H=50": ("diloco", {"sync_every": 50}),
    "diloco H=100": ("diloco", {"sync_every": 100}),
    "streaming P=4 int4 H=50": ("streaming_diloco", {**STREAMING, "exchange_dtype": "int4"}),
    "diloco H=15": ("diloco", {"sync_every": 15}),
    "diloco H=30": ("diloco", {"sync_every": 30}),
    "sparseloco H=15 k=64 (1.6%)": ("sparseloco", {"sync_every": 15, "topk": 64}),
    "sparseloco H=15 k=128 (3.1%)": ("sparseloco", {"sync_every": 15, "topk": 128}),
    "sparseloco H=30 k=64 (1.6%)": ("sparseloco", {"sync_every": 30, "topk": 64}),
    "sparseloco H=30 k=128 (3.1%)": ("sparseloco", {"sync_every": 30, "topk": 128}),
    # the authors' DiLoCo loop clips each inner step's gradients to norm 1 (tplr's strategies.py)
    "sparseloco H=15 k=128 (3.1%) clip 1": ("sparseloco", {"sync_every": 15, "topk": 128, "clipping": CLIP}),
    "sparseloco H=15 k=64 (1.6%) clip 1": ("sparseloco", {"sync_every": 15, "topk": 64, "clipping": CLIP}),
    "diloco H=15 clip 1": ("diloco", {"sync_every": 15, "clipping": CLIP}),
    "sparseloco H=50 k=64 (1.6%)": ("sparseloco", {"sync_every": 50, "topk": 64}),
    "sparseloco H=50 k=128 (3.1%)": ("sparseloco", {"sync_every": 50, "topk": 128}),
}
# the authors' DeMo: 64 × 64 tiles, β 0.999, its own decoupled weight decay
DEMO = {"compression_decay": 0.999, "chunk_size": 64, "weight_decay": 0.1}
RUNS |= {
    "demo topk=32 (0.78%)": ("demo", {**DEMO, "topk": 32}),
    "demo topk=64 (1.6%)": ("demo", {**DEMO, "topk": 64}),
}
WIDE_RUNS = [
    "DDP",
    "diloco H=15",
    "sparseloco H=15 k=64 (1.6%)",
    "sparseloco H=15 k=128 (3.1%)",
    "demo topk=32 (0.78%)",
]


def default_runs(model: str) -> list[str]:
    """Every run but the clipped ones for the narrow GPT; for the wide one, the runs that show how the ratios move
    with size."""
    return [label for label in RUNS if not label.endswith("clip 1")] if model == "narrow" else WIDE_RUNS


GLOBAL_WEIGHTS = ("diloco", "streaming_diloco", "sparseloco")  # evaluated on θ_global, as the papers do
SENT = {  # what a rank sends per byte of the buffer it hands the collective, in a world of W (ring algorithms)
    "all_reduce": lambda world: 2 * (world - 1) / world,
    "all_reduce_": lambda world: 2 * (world - 1) / world,
    "all_to_all_single": lambda world: (world - 1) / world,
    "reduce_scatter_tensor": lambda world: (world - 1) / world,
    "all_gather_into_tensor": lambda world: world - 1,  # its whole message to each of the others
}


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    """The documentation text as character ids: training and held-out parts, and the vocabulary size."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = len(ids) * 9 // 10
    return ids[:cut], ids[cut:], len(chars)


def windows(ids: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - SEQ - 1, (n,), generator=gen)
    rows = torch.stack([ids[s : s + SEQ + 1] for s in starts.tolist()])
    return rows[:, :-1].contiguous(), rows[:, 1:].reshape(-1).contiguous()


SIZES = {"narrow": (4, 192, 4), "wide": (4, 320, 5)}  # --model: blocks, width, heads (1.8M and 5.0M parameters)


def model_for(vocab: int, seed: int, size: str = "narrow") -> nn.Module:
    torch.manual_seed(seed)
    blocks, dim, heads = SIZES[size]
    return NarrowGPT(blocks=blocks, dim=dim, heads=heads, vocab=vocab, seq=SEQ)


def sent_bytes(program, world: int) -> tuple[float, int]:
    """What one rank sends in one run of ``program``, and its largest message."""
    total, peak = 0.0, 0
    for node in program.graph.nodes:
        if "collective" not in node.meta:
            continue
        op = node.target._schema.name.split("::")[-1]
        given = node_bytes(node.args[0])
        total += SENT[op](world) * given
        peak = max(peak, given)
    return total, peak


def held_out_loss(model: nn.Module, held: torch.Tensor) -> float:
    gen = torch.Generator().manual_seed(1234)
    losses = []
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            x, y = windows(held, PER_RANK, gen)
            losses.append(float(nn.functional.cross_entropy(model(x), y)))
    return sum(losses) / len(losses)


def warmed_up(steps: int, train: torch.Tensor, vocab: int, seed: int, size: str) -> dict[str, torch.Tensor]:
    """The start of every run: the seed's weights, trained by DDP for ``steps`` steps (none: as they are)."""
    model = model_for(vocab, seed, size)
    if steps:
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        gen = torch.Generator().manual_seed(50 + 1000 * seed + dist.get_rank())
        for _ in range(steps):
            x, y = windows(train, PER_RANK, gen)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lr_factor(schedule: str, t: int, steps: int) -> float:
    """The inner lr at step ``t`` over ``LR``: constant, or a cosine from 1 down to ``FLOOR`` at the last step
    (the paper's inner schedule after its warm-up; every run, DDP's included, takes the same)."""
    if schedule == "constant":
        return 1.0
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))


def run(label: str, args: argparse.Namespace, train: torch.Tensor, held: torch.Tensor, vocab: int, start: dict) -> dict:
    mode, options = RUNS[label]
    steps, schedule, seed = args.steps, args.schedule, args.seed
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_for(vocab, seed, args.model)
    model.load_state_dict(start)
    if mode == "demo":  # DeMo's update is the sign of the decoded mean, which plain SGD applies (the paper's)
        inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=DEMO_LR)  # the decay is DeMo's
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    decay = torch.optim.lr_scheduler.LambdaLR(inner, lambda t: lr_factor(schedule, t, steps))
    params = sum(p.numel() for p in model.parameters())
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)

        def step(x, y):
            inner.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            inner.step()
            return loss.detach()

    else:
        step = transpile(model, inner, mode_config(mode, **options), loss_fn=nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(100 + 1000 * seed + rank)
    times, sent, peak, losses = [], 0.0, 0, []
    by_variant: dict[str, list[float]] = {}
    for _ in range(steps):
        x, y = windows(train, PER_RANK, gen)
        start = time.perf_counter()
        losses.append(float(step(x, y)))
        times.append(time.perf_counter() - start)
        decay.step()
        variant = "step" if mode == "ddp" else step.last_variant.rstrip("0123456789")
        by_variant.setdefault(variant, []).append(times[-1])
        if mode == "ddp":
            sent += 2 * (world - 1) / world * 4 * params
            peak = max(peak, 4 * params)  # at most: DDP's buckets are 25 MiB, the model is smaller
        else:
            s, p = sent_bytes(step.programs[step.last_variant], world)
            sent, peak = sent + s, max(peak, p)
    if mode in GLOBAL_WEIGHTS:
        with step.global_weights() as evaluated:
            loss = held_out_loss(evaluated, held)
    else:
        loss = held_out_loss(model, held)
    slowest = torch.tensor([statistics.median(times)] + [statistics.median(by_variant[v]) for v in sorted(by_variant)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {
        "label": label,
        "held_out_loss": loss,
        "train_loss_last50": sum(losses[-50:]) / len(losses[-50:]),
        "bytes_sent": sent,
        "peak_message": peak,
        "step_ms": 1000 * float(slowest[0]),
        "variant_ms": {v: 1000 * float(t) for v, t in zip(sorted(by_variant), slowest[1:])},
        "params": params,
    }


def worker(out: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    train, held, vocab = corpus()
    start = warmed_up(args.warmup_steps, train, vocab, args.seed, args.model)
    results = []
    for label in args.runs:
        result = run(label, args, train, held, vocab, start)
        results.append(result | {"warmup": args.warmup_steps, "schedule": args.schedule, "seed": args.seed})
        if dist.get_rank() == 0:
            print(json.dumps(results[-1]), flush=True)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def table(results: list[dict], steps: int, world: int) -> str:
    ddp = next(r for r in results if r["label"] == "DDP")
    tokens = steps * world * PER_RANK * SEQ
    warmup = results[0].get("warmup", 0)
    start = f"after {warmup} DDP steps shared by all runs" if warmup else "from the same random weights"
    lr = "a cosine inner lr" if results[0].get("schedule") == "cosine" else "a constant inner lr"
    lines = [
        f"W={world} ranks over gloo on {platform.processor() or platform.machine()} ({os.cpu_count()} cores), "
        f"{steps} steps of {PER_RANK}x{SEQ} characters per rank ({tokens:,} tokens in all) {start}, {lr}, "
        f"GPT of {ddp['params']:,} parameters.",
        "",
        "| run | held-out loss | vs DDP | bytes sent per rank | vs DDP | peak message | step (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        gap = 100 * (r["held_out_loss"] / ddp["held_out_loss"] - 1)
        lines.append(
            f"| {r['label']} | {r['held_out_loss']:.4f} | {gap:+.1f}% "
            f"| {r['bytes_sent'] / 2**20:,.1f} MiB | 1/{ddp['bytes_sent'] / max(r['bytes_sent'], 1):,.0f} "
            f"| {r['peak_message'] / 2**10:,.0f} KiB | {r['step_ms']:.0f} ms |"
        )
    lines += [
        "",
        "Median step time by program (slower rank), syncs apart from inner steps:",
        "",
        "| run | " + " | ".join(VARIANT_NAMES.values()) + " |",
        "|---|" + "---:|" * len(VARIANT_NAMES),
    ]
    for r in results:
        cells = [f"{r['variant_ms'][v]:.0f} ms" if v in r["variant_ms"] else "–" for v in VARIANT_NAMES]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


VARIANT_NAMES = {  # program (its fragment number dropped) -> column
    "step": "step (DDP, DeMo)",
    "local": "local (LocalSGD)",
    "inner": "inner",
    "sync": "sync (streaming: starts an exchange)",
    "apply": "apply (streaming: waits, outer step)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=0, help="DDP steps before every run, shared")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="the inner lr")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), help="which runs (DDP first; default: all)")
    parser.add_argument("--model", choices=list(SIZES), default="narrow", help="the GPT's size (SIZES)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' and the data's seed (0: the docs' tables)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.runs = args.runs or default_runs(args.model)
    if args.worker:
        worker(args.worker, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world)]
        cmd += ["--master-port", "29561", __file__, "--worker", str(out), "--steps", str(args.steps)]
        cmd += ["--warmup-steps", str(args.warmup_steps), "--schedule", args.schedule, "--seed", str(args.seed)]
        cmd += ["--model", args.model]
        cmd += ["--runs", *args.runs]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), cwd=ROOT)
        results = json.loads(out.read_text())
    text = table(results, args.steps, args.world)
    print(text)
    if args.seed or args.runs != default_runs(args.model):  # the page's tables: seed 0, the default runs
        return
    marker = ("warm" if args.warmup_steps else "cold") + ("" if args.model == "narrow" else f"-{args.model}")
    write_section(DOC, BEGIN.replace("diloco:", f"diloco-{marker}:"), END.replace("diloco:", f"diloco-{marker}:"), text)


if __name__ == "__main__":
    main()
