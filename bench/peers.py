"""Each mode beside the peer its users would run instead, in one run: step time, ops, bytes sent and bytes held.

    python -m bench.peers            # one torchrun world of 2 over gloo, about 3 minutes; writes docs/performance.md

Rows (issue 77), every pair built on this rank from the same weights and batches, torch's own code for the peer:

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
  (``bucket_cap_mb=25``, DDP's own default, given explicitly), as in ``bench/wan_worker.py``.

Per row: the ops one round of steps dispatches (4 steps: ``local_sgd``'s round; ``bench/op_count.py``: work ops,
about one kernel launch each on a GPU, and views), the bytes this rank hands to collectives in that round
(``bench/op_count.py``: each collective's input, what a rank contributes, not what the algorithm moves), the
bytes it holds between steps (parameters, gradients and optimizer state, each storage once; ours
``memory_report().held``), its peak (that plus the most a round of steps allocates above it at once, from the
profiler's memory records: ``bench/tensor_parallel.py:step_rise``), and the step time: ``ROUNDS`` rounds, each
timing the mode's steps then the peer's (``bench/host_ops.py:interleaved_ms``: untimed steps, then timed ones
after a barrier), the ratio of the two per round, its median over the rounds, the slower rank's. Measured
elsewhere (docs/performance.md says where): tensor parallelism against eager TP + FSDP2
(``bench/tensor_parallel.py``), the DiLoCo family against torchft's (``bench/wan.py``, ``bench/diloco_inner.py``),
DeMo in its authors' loop (``bench/demo_peer.py``), the quorum against torchft's ``Manager`` + DDP
(``bench/fault_tolerance.py``); SparseLoCo in tplr's loop nowhere yet.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.fsdp import adamw, fsdp2, held_bytes
from bench.host_ops import ROUNDS, STEPS, interleaved_ms
from bench.models import NarrowGPT, narrow_batch
from bench.op_count import count_ops
from bench.tensor_parallel import step_rise
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import Compression, Sparsification, mode_config, transpile

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- peers -->", "<!-- /peers -->"
PER_RANK, ROUND, WARMUP = 4, 4, 4  # samples per rank; steps counted; steps before counting
PERIOD = 4  # local_sgd's k and PostLocalSGDOptimizer's period
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "narrow": ("narrow GPT (12 blocks, d=16: the host's dispatching is the step)", lambda: NarrowGPT()),
    "wide": ("wide GPT (4 blocks, d=256)", lambda: NarrowGPT(blocks=4, dim=256, heads=4)),
}
# (mode's label, peer's label): each built by :func:`build`
ROWS: tuple[tuple[str, str], ...] = (
    ("fused_allreduce", "DDP"),
    ("zero1", "DDP + ZeroRedundancyOptimizer"),
    ("zero2", "FSDP2, no reshard"),
    ("zero3", "FSDP2"),
    (f"local_sgd k={PERIOD}", f"PostLocalSGDOptimizer period {PERIOD}"),
    ("fused_allreduce, fp16 compression", "DDP + fp16_compress_hook"),
    ("fused_allreduce, 1% top-K sparsification", "DDP + powerSGD_hook r=4"),
)


class Built:
    """One variant's step on this rank, and what it holds between steps."""

    def __init__(self, run: Callable[[], object], model: nn.Module, optimizer=None, transpiled=None) -> None:
        self.run, self.model, self.optimizer, self.transpiled = run, model, optimizer, transpiled

    def held_bytes(self) -> int:
        if self.transpiled is not None:
            return self.transpiled.memory_report().held
        return held_bytes(self.model, self.optimizer)


def build(label: str, base: nn.Module, batches: list[tuple]) -> Built:
    """The variant ``label`` on a copy of ``base``: a step function taking the next of ``batches`` each call."""
    model, loss_fn = copy.deepcopy(base), nn.CrossEntropyLoss()
    feed = _cycle(batches)
    if label in ROWS_OURS:
        config = ROWS_OURS[label]
        transpiled = transpile(model, adamw(model.parameters()), config, loss_fn, batches[0])
        return Built(lambda: transpiled(*next(feed)), model, transpiled=transpiled)
    if label.startswith("FSDP2"):
        wrapped, optimizer = fsdp2(model, reshard="no reshard" not in label), adamw(model.parameters())
        return Built(_eager(wrapped, optimizer, feed), model, optimizer)
    one_bucket = {"bucket_cap_mb": 25} if "powerSGD" in label else {}  # module docstring
    ddp = DDP(model, gradient_as_bucket_view=True, **one_bucket)
    optimizer = _peer_optimizer(label, ddp)
    _register_hook(label, ddp)
    return Built(_eager(ddp, optimizer, feed), model, optimizer)


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
}


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
    ms = interleaved_ms({key: variant.run for key, variant in variants.items()})  # bench/host_ops.py's rounds
    row["ratio"] = statistics.median(ours / peer for ours, peer in zip(ms["ours"], ms["peer"]))
    row["ms"] = {key: statistics.median(times) for key, times in ms.items()}
    return row


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
        result[key] = [measure(base, batches, ours, peer) for ours, peer in ROWS]
    finish_rank(out, result)


def render(ranks: list[dict]) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"`python -m bench.peers` (W=2 over gloo, one thread per rank, AdamW, {PER_RANK} sequences of 16 tokens per "
        f"rank, torch {torch.__version__}, {os.cpu_count()} cores, {cpu}): step ms the median over {ROUNDS} rounds "
        f"of {STEPS} steps, the ratio the median of each round's (the slower rank's); ops and bytes sent over "
        f"{ROUND} steps, rank 0; held: bytes rank 0 holds between steps; peak: held plus the most those {ROUND} steps "
        "allocate above it at once.",
        "",
    ]
    for key, (title, _) in MODELS.items():
        lines += [
            f"**{title}**",
            "",
            "| mode | peer | step ms | peer ms | × peer | work ops | × peer | views | × peer | sent KiB | × peer "
            "| held KiB | × peer | peak KiB | × peer |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, (ours, peer) in enumerate(ROWS):
            row = ranks[0][key][i]
            ratio = max(r[key][i]["ratio"] for r in ranks)
            ms = {k: max(r[key][i]["ms"][k] for r in ranks) for k in ("ours", "peer")}
            a, b = row["ours"], row["peer"]
            cells = [f"{a['work']} | {_x(a['work'], b['work'])}", f"{a['views']} | {_x(a['views'], b['views'])}"]
            cells += [f"{a['sent'] / 1024:.0f} | {_x(a['sent'], b['sent'])}"]
            cells += [f"{a['held'] / 1024:.0f} | {_x(a['held'], b['held'])}"]
            cells += [f"{a['peak'] / 1024:.0f} | {_x(a['peak'], b['peak'])}"]
            lines.append(
                f"| {ours} | {peer} | {ms['ours']:.1f} | {ms['peer']:.1f} | {ratio:.2f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def _x(ours: float, peer: float) -> str:
    return f"{ours / peer:.2f}" if peer else "–"


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, _tmp: [out], port=29563)
    text = render(ranks)
    print(text)
    write_section(DOC, BEGIN, END, text)


if __name__ == "__main__":
    entry(worker, main)
