"""Each mode beside the peer its users would run instead, in one run: step time, ops, bytes sent and bytes held.

    python -m bench.peers     # torchrun worlds of 2 then 4, then the quorum's jobs; about 20 minutes; writes the doc
    python -m bench.peers --rows diloco zero    # only the world of 2's rows with these words in a label; no doc

Rows (issue 77), every pair built on this rank from the same weights and batches, the peer its own code (torch's,
torchft's, or written from its authors'):

- ``fused_allreduce`` against DDP (foreach AdamW, gradients as bucket views);
- ``zero1`` against DDP with ``ZeroRedundancyOptimizer`` (foreach AdamW sharded over the ranks);
- ``zero2`` against FSDP2 without resharding after the forward (``fully_shard`` per block and the root, as
  torchtitan applies it: ZeRO-2's layout), ``zero3`` against FSDP2 with it (its default);
- ``local_sgd`` (k = 4) against DDP with ``post_localSGD_hook`` on groups of one rank (no gradient exchange) and
  ``PostLocalSGDOptimizer`` averaging the parameters every 4 steps (``PeriodicModelAverager``);
- ``fused_allreduce`` with fp16 ``Compression`` against DDP's ``fp16_compress_hook``;
- ``fused_allreduce`` with 1% top-K ``Sparsification`` (error feedback) against DDP's ``powerSGD_hook`` (rank 4,
  error feedback, warm start, from the 2nd step): the two ways to send a few per cent of DDP's bytes a user would
  weigh, different compressors (``bench/wan.py`` sets them side by side on time to a loss). PowerSGD's callbacks
  start all-reduces from gloo's thread: with DDP's small first bucket the two ranks issued two buckets'
  all-reduces in different orders and gloo failed (sizes differ), so the peer has one bucket
  (``bucket_cap_mb=25``, DDP's own default, given explicitly), as in ``bench/wan_worker.py``;
- ``demo`` against bloc97's ``DeMo`` optimizer in their loop (``bench/demo_peer.py``), both SGD on the exchanged
  sign at the mode's defaults (chunk 64, top-32, decay 0.999);
- ``sparseloco`` (H = 4, the mode's defaults) against tplr's ``Diloco`` loop driving its ``SparseLoCo`` optimizer
  (``bench/sparseloco_peer.py``), AdamW inside both. ``tests/test_bench_peers.py`` holds both peers to the modes
  bit for bit, so each row compares two ways of computing the same numbers;
- ``diloco`` (H = 4, outer Nesterov SGD at 0.7, its default) against torchft's ``DiLoCo`` with a ``Manager`` per rank
  under a lighthouse rank 0 serves (``bench/peers_torchft.py``), AdamW inside both;
- ``streaming_diloco`` (H = 8, 2 fragments, τ = 1: a fragment starts its exchange every 4 steps and applies it a
  step later, float32 on the wire) against torchft's ``DiLoCo`` over the same two fragments (whole modules,
  balanced by size, ``passes/partitions.py``), with the same H and ``fragment_sync_delay``: torchft starts a
  fragment's all-reduce one step before it ends its round and ours one step after, the same cadence;
- then, in a world of 4 (dp=2 × tp=2), tensor parallelism: ``fused_allreduce``, ``zero2`` and ``zero3`` on
  torchtitan's plan against eager TP + FSDP2, as ``bench/tensor_parallel.py`` times them (``bench/peers_tp.py``).

Per row: the ops one round of steps dispatches (4 steps: ``local_sgd``'s round; ``bench/op_count.py``: work ops,
about one kernel launch each on a GPU, and views), the bytes this rank hands to collectives in that round
(``bench/op_count.py``: each collective's input, what a rank contributes, not what the algorithm moves), the
bytes it holds between steps (parameters, gradients and optimizer state, each storage once; ours
``memory_report().held``), its peak (that plus the most a round of steps allocates above it at once, from the
profiler's memory records: ``bench/tensor_parallel.py:step_rise``), and the step time: ``ROUNDS`` rounds, each
timing the mode's steps then the peer's (``bench/host_ops.py:interleaved_ms``: untimed steps, then timed ones
after a barrier), the ratio of the two per round, its median over the rounds, the slower rank's. For the rows
whose steps differ within a round (``ROUND_BASED``), also the inner step and what the syncs add to a round
(:func:`inner_and_sync_ms`), the issue's sync time. Measured
elsewhere (docs/performance.md says where): the DiLoCo family over shaped links (``bench/wan.py``). Last, the
quorum against torchft's ``Manager`` + DDP and against no quorum, each replica group a torchrun job of its own
(``bench/peers_quorum.py``), timing only.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.demo_peer import AuthorsDeMo
from bench.fsdp import adamw, fsdp2, held_bytes
from bench.host_ops import ROUNDS, STEPS, interleaved_ms
from bench.models import NarrowGPT, narrow_batch
from bench.op_count import count_ops
from bench.peers_quorum import TITLE as QUORUM_TITLE
from bench.peers_quorum import quorum_rounds, quorum_rows
from bench.peers_torchft import TorchftDiLoCo
from bench.peers_tp import TITLE as TP_TITLE
from bench.peers_tp import tp_rows, tp_world
from bench.sparseloco_peer import TplrDiLoCo, TplrSparseLoCo
from bench.tensor_parallel import step_rise
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import Compression, DiLoCo, SparseLoCo, Sparsification, StreamingDiLoCo, mode_config, transpile

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- peers -->", "<!-- /peers -->"
PER_RANK, ROUND, WARMUP = 4, 4, 4  # samples per rank; steps counted; steps before counting
PERIOD = 4  # local_sgd's k and PostLocalSGDOptimizer's period; sparseloco's H and tplr's
LR = 1e-3
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "narrow": ("narrow GPT (12 blocks, d=16: the host's dispatching is the step)", lambda: NarrowGPT()),
    "wide": ("wide GPT (4 blocks, d=256)", lambda: NarrowGPT(blocks=4, dim=256, heads=4)),
}
STREAMING = StreamingDiLoCo(sync_every=2 * PERIOD, fragments=2, fragment_sync_delay=1)  # a fragment every PERIOD
STREAMING_LABEL = f"streaming_diloco H={STREAMING.sync_every}, {STREAMING.fragments} fragments, τ=1"
# (mode's label, peer's label): each built by :func:`build`
ROWS: tuple[tuple[str, str], ...] = (
    ("fused_allreduce", "DDP"),
    ("zero1", "DDP + ZeroRedundancyOptimizer"),
    ("zero2", "FSDP2, no reshard"),
    ("zero3", "FSDP2"),
    (f"local_sgd k={PERIOD}", f"PostLocalSGDOptimizer period {PERIOD}"),
    ("fused_allreduce, fp16 compression", "DDP + fp16_compress_hook"),
    ("fused_allreduce, 1% top-K sparsification", "DDP + powerSGD_hook r=4"),
    ("demo (SGD)", "bloc97's DeMo"),
    (f"sparseloco H={PERIOD}", f"tplr's SparseLoCo, H={PERIOD}"),
    (f"diloco H={PERIOD}", f"torchft DiLoCo, H={PERIOD}"),
    (STREAMING_LABEL, f"torchft Streaming DiLoCo, H={STREAMING.sync_every}, {STREAMING.fragments} fragments, τ=1"),
)
SPARSELOCO = SparseLoCo(sync_every=PERIOD)  # the mode's defaults; tplr's optimizer gets the same


def _nothing() -> None:
    pass


class Built:
    """One variant's step on this rank, and the bytes it holds between steps."""

    def __init__(
        self, run: Callable[[], object], held: Callable[[], int], close: Callable[[], None] = _nothing
    ) -> None:
        self.run, self.held_bytes, self.close = run, held, close


def build(label: str, base: nn.Module, batches: list[tuple]) -> Built:
    """The variant ``label`` on a copy of ``base``: a step function taking the next of ``batches`` each call."""
    model, loss_fn = copy.deepcopy(base), nn.CrossEntropyLoss()
    feed = _cycle(batches)
    if label in ROWS_OURS:
        optimizer = _sgd(model) if label.startswith("demo") else adamw(model.parameters())
        transpiled = transpile(model, optimizer, ROWS_OURS[label], loss_fn, batches[0])
        return Built(lambda: transpiled(*next(feed)), lambda: transpiled.memory_report().held)
    if label.startswith("tplr"):
        o = SPARSELOCO
        sparsity = (o.error_decay, o.topk, o.chunk_size, o.quantization_bins, o.quantization_range)
        outer = TplrSparseLoCo(model.parameters(), o.outer_lr, *sparsity)
        loop = TplrDiLoCo(model, adamw(model.parameters()), outer, o.sync_every)
        return Built(lambda: loop(*next(feed)), lambda: held_bytes(model, loop.inner, loop.kept()))
    if label.startswith("torchft"):
        inner = adamw(model.parameters())
        s = STREAMING
        streaming = (s.sync_every, s.fragments, s.fragment_sync_delay) if "Streaming" in label else (PERIOD,)
        peer = TorchftDiLoCo(model, inner, *streaming)
        return Built(_eager(model, inner, feed), lambda: held_bytes(model, inner, peer.kept()), peer.close)
    if label.startswith("bloc97"):
        wrapped, optimizer = model, AuthorsDeMo(model.parameters(), lr=LR)  # their loop: no DDP, no all-reduce
    elif label.startswith("FSDP2"):
        wrapped, optimizer = fsdp2(model, reshard="no reshard" not in label), adamw(model.parameters())
    else:
        one_bucket = {"bucket_cap_mb": 25} if "powerSGD" in label else {}  # module docstring
        wrapped = DDP(model, gradient_as_bucket_view=True, **one_bucket)
        optimizer = _peer_optimizer(label, wrapped)
        _register_hook(label, wrapped)
    return Built(_eager(wrapped, optimizer, feed), lambda: held_bytes(model, optimizer))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """DeMo's optimizer, the authors' and the mode's: SGD on the exchanged sign."""
    return torch.optim.SGD(model.parameters(), lr=LR)


ROWS_OURS = {
    "fused_allreduce": "fused_allreduce",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    f"local_sgd k={PERIOD}": mode_config("local_sgd", k_steps=PERIOD),
    "fused_allreduce, fp16 compression": mode_config("fused_allreduce", compression=Compression(wire_dtype="fp16")),
    "fused_allreduce, 1% top-K sparsification": mode_config(
        "fused_allreduce", sparsification=Sparsification(ratio=0.01)
    ),
    "demo (SGD)": "demo",
    f"sparseloco H={PERIOD}": SPARSELOCO,
    f"diloco H={PERIOD}": DiLoCo(sync_every=PERIOD),
    STREAMING_LABEL: STREAMING,
}
# the rows whose steps differ within a round of PERIOD steps: an inner step and what the syncs add, apart
ROUND_BASED = (f"local_sgd k={PERIOD}", f"sparseloco H={PERIOD}", f"diloco H={PERIOD}", STREAMING_LABEL)


def _peer_optimizer(label: str, ddp: DDP) -> torch.optim.Optimizer:
    if label == "DDP + ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, foreach=True)
    if label.startswith("PostLocalSGDOptimizer"):
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        averager = PeriodicModelAverager(period=PERIOD, warmup_steps=0)
        return PostLocalSGDOptimizer(optim=adamw(ddp.parameters()), averager=averager)
    return adamw(ddp.parameters())


def _register_hook(label: str, ddp: DDP) -> None:
    """The peer's DDP communication hook, where it has one."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    if label == "DDP + fp16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif "powerSGD" in label:
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif label.startswith("PostLocalSGDOptimizer"):
        alone, _ = dist.new_subgroups(group_size=1)  # every rank builds every group; each gets its own
        state = post_localSGD_hook.PostLocalSGDState(None, subgroup=alone, start_localSGD_iter=0)
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)


def _eager(model: nn.Module, optimizer: torch.optim.Optimizer, feed) -> Callable[[], None]:
    loss_fn = nn.CrossEntropyLoss()

    def run() -> None:
        x, y = next(feed)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    return run


def _cycle(batches: list[tuple]):
    while True:
        yield from batches


def measure(base: nn.Module, batches: list[tuple], ours: str, peer: str) -> dict:
    """One row on this rank: ops, bytes sent and held, and the step-time ratio per round (module docstring)."""
    variants = {"ours": build(ours, base, batches), "peer": build(peer, base, batches)}
    row: dict = {}
    for key, variant in variants.items():
        for _ in range(WARMUP):
            variant.run()
        counter = count_ops(lambda run=variant.run: [run() for _ in range(ROUND)])
        row[key] = {
            "work": counter.work,
            "views": counter.views,
            "sent": counter.sent,
            "held": variant.held_bytes(),
            "peak": variant.held_bytes() + step_rise(lambda run=variant.run: [run() for _ in range(ROUND)]),
        }
    runs = {key: variant.run for key, variant in variants.items()}
    ms = interleaved_ms(runs)  # bench/host_ops.py's rounds
    row["ratio"] = statistics.median(ours / peer for ours, peer in zip(ms["ours"], ms["peer"]))
    row["ms"] = {key: statistics.median(times) for key, times in ms.items()}
    if ours in ROUND_BASED:
        row["round"] = inner_and_sync_ms(runs)
    for variant in variants.values():
        variant.close()
    return row


def inner_and_sync_ms(runs: dict[str, Callable[[], object]]) -> dict[str, dict[str, float]]:
    """Per variant, its inner step and what its syncs add to a round of ``PERIOD`` steps, in ms: each step timed
    alone (``ROUNDS`` rounds, each variant in turn after a barrier, two of its rounds of steps each, so every
    position of a round keeps its place), the median per position; ``inner`` the fastest position's, ``sync`` the
    positions' sum less ``PERIOD`` inner steps."""
    times: dict[str, list[list[float]]] = {key: [[] for _ in range(PERIOD)] for key in runs}
    for _ in range(ROUNDS):
        for key, run in runs.items():
            for _ in range(PERIOD):  # untimed, as interleaved_ms's warm-up: a whole round keeps the phase
                run()
            dist.barrier()
            for i in range(2 * PERIOD):
                start = time.perf_counter()
                run()
                times[key][i % PERIOD].append((time.perf_counter() - start) * 1000)
    out = {}
    for key, positions in times.items():
        medians = [statistics.median(t) for t in positions]
        out[key] = {"inner": min(medians), "sync": sum(medians) - PERIOD * min(medians)}
    return out


def worker(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result: dict = {}
    for key, (_, make) in MODELS.items():
        torch.manual_seed(0)
        base = make()
        gen = torch.Generator().manual_seed(rank)
        batches = [narrow_batch("gpt", PER_RANK, gen) for _ in range(ROUND)]
        result[key] = [measure(base, batches, ours, peer) for ours, peer in chosen_rows()]
    finish_rank(out, result)


def world_rows(ranks: list[dict], key: str) -> list[dict]:
    """Model ``key``'s rows from every rank's records: the slower rank's ratio and ms; rank 0's ops, bytes and
    memory (``ours`` and ``peer``: work, views, sent, held, peak)."""
    rows = []
    for i, labels in enumerate(chosen_rows()):
        ms = {k: max(r[key][i]["ms"][k] for r in ranks) for k in ("ours", "peer")}
        rows.append({**ranks[0][key][i], "labels": labels, "ratio": max(r[key][i]["ratio"] for r in ranks), "ms": ms})
        if "round" in ranks[0][key][i]:  # the slower rank's inner step and syncs
            rows[-1]["round"] = {
                k: {part: max(r[key][i]["round"][k][part] for r in ranks) for part in ("inner", "sync")}
                for k in ("ours", "peer")
            }
    return rows


def chosen_rows() -> tuple[tuple[str, str], ...]:
    """``ROWS``, or those whose labels contain one of ``--rows``'s words (passed to the ranks as ``PEERS_ROWS``)."""
    words = [w for w in os.environ.get("PEERS_ROWS", "").split(",") if w]
    return tuple(r for r in ROWS if not words or any(w in label for label in r for w in words))


def render(sections: dict[str, list[dict]]) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"`python -m bench.peers` (W=2 over gloo, one thread per rank, AdamW, {PER_RANK} sequences of 16 tokens per "
        f"rank, torch {torch.__version__}, {os.cpu_count()} cores, {cpu}): step ms the median over {ROUNDS} rounds "
        f"of {STEPS} steps, the ratio the median of each round's (the slower rank's); ops and bytes sent over "
        f"{ROUND} steps, rank 0; held: bytes rank 0 holds between steps; peak: held plus the most those {ROUND} steps "
        "allocate above it at once.",
        "",
    ]
    for title, rows in sections.items():
        lines += [
            f"**{title}**",
            "",
            "| mode | peer | step ms | peer ms | × peer | work ops | × peer | views | × peer | sent KiB | × peer "
            "| held KiB | × peer | peak KiB | × peer |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            a, b = row.get("ours"), row.get("peer")
            cells = ["– | –"] * 5
            if a is not None:
                cells = [f"{a['work']} | {_x(a['work'], b['work'])}", f"{a['views']} | {_x(a['views'], b['views'])}"]
                cells += [f"{a[k] / 1024:.0f} | {_x(a[k], b[k])}" for k in ("sent", "held", "peak")]
            ours, peer = row["labels"]
            ms = row["ms"]
            lines.append(
                f"| {ours} | {peer} | {ms['ours']:.1f} | {ms['peer']:.1f} | {row['ratio']:.2f} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
        lines += round_table(rows)
    return "\n".join(lines)


def round_table(rows: list[dict]) -> list[str]:
    """The round-based rows' inner step and what their syncs add to a round (:func:`inner_and_sync_ms`)."""
    timed = [row for row in rows if "round" in row]
    if not timed:
        return []
    lines = [
        f"Round-based rows: an inner step, and what the syncs add to a round of {PERIOD} steps above {PERIOD} inner "
        "steps (each step timed alone, the median per position of a round, the slower rank):",
        "",
        "| mode | inner ms | peer | × peer | sync ms per round | peer | × peer |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in timed:
        a, b = row["round"]["ours"], row["round"]["peer"]
        lines.append(
            f"| {row['labels'][0]} | {a['inner']:.1f} | {b['inner']:.1f} | {_x(a['inner'], b['inner'])} "
            f"| {a['sync']:.1f} | {b['sync']:.1f} | {_x(a['sync'], b['sync'])} |"
        )
    return [*lines, ""]


def _x(ours: float, peer: float) -> str:
    return f"{ours / peer:.2f}" if peer else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        nargs="+",
        default=[],
        help="only the world of 2's rows whose labels contain one of these words; "
        "no tensor-parallel or quorum section, and the doc is left as it is",
    )
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Managers log every quorum and vote at INFO
    os.environ["PEERS_ROWS"] = ",".join(args.rows)
    if not chosen_rows():
        parser.error(f"no row's labels contain any of {args.rows}")
    ranks = two_rank_results(__file__, lambda out, _tmp: [out], port=29563)
    sections = {title: world_rows(ranks, key) for key, (title, _) in MODELS.items()}
    if not args.rows:
        sections[TP_TITLE] = tp_rows(tp_world(port=29564))
        sections[QUORUM_TITLE] = quorum_rows(quorum_rounds())
    text = render(sections)
    print(text)
    if not args.rows:
        write_section(DOC, BEGIN, END, text)


if __name__ == "__main__":
    entry(worker, main)
