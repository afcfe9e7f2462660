"""Three-dimensional parallelism on the CPU: dp=2 × pp=2 × tp=2 in a world of 8 processes, the traced step
(torch's tensor-parallel plan on ``mesh["tp"]``, ``PipelineParallel`` on ``mesh["pp"]``, a mode across
``mesh["dp"]``) against the layout a user would otherwise run (torchtitan's: eager TP inside
``torch.distributed.pipelining``'s stages, each shard's gradient averaged over ``dp``), and both against the 1-D
run (one process training the unsplit model on the whole batch), on real text.

    python -m bench.pipeline_3d                 # 40 steps, zero2 across dp, 1F1B, 4 microbatches
    python -m bench.pipeline_3d --steps 100 --mode fused_allreduce --schedule zbh1

Model: ``bench/models.py``'s TinyLlama (4 blocks, width 64, 4 heads) under torchtitan's plan, a character model of
the Zen of Python (``this``), 8 sequences of 32 characters per data-parallel rank and step, AdamW. The two 3-D runs
train in lockstep, one step of each in turn, so the machine's drift falls on both; step time is the median over
steps of the slowest rank. The loss curves go into ``docs/strategies/pipeline_3d.png``, the table into
``docs/strategies/pipeline.md``.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import os
import platform
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from bench.models import TinyLlama, TinyLlamaStage, llama_tp_plan, pipelining_step
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import PipelineParallel, transpile

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m bench.pipeline_3d"
DOC = ROOT / "docs" / "strategies" / "pipeline.md"
FIGURE = ROOT / "docs" / "strategies" / "pipeline_3d.png"
BEGIN, END = "<!-- bench/pipeline_3d.py begin -->", "<!-- bench/pipeline_3d.py end -->"
BLOCKS, DIM, HEADS, HIDDEN, VOCAB = 4, 64, 4, 128, 64
PER_RANK, SEQ = 8, 32
SHAPE = (2, 2, 2)  # pp, dp, tp


def zen() -> torch.Tensor:
    """The Zen of Python as character ids (its alphabet, under 64 characters)."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
        import this

    text = codecs.decode(this.s, "rot13")
    alphabet = sorted(set(text))
    return torch.tensor([alphabet.index(c) for c in text])


def batches(text: torch.Tensor, dp_rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, this data-parallel rank's windows of ``SEQ + 1`` characters (inputs, next characters)."""
    gen = torch.Generator().manual_seed(1 + dp_rank)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - SEQ - 1, (PER_RANK,), generator=gen)
        windows = torch.stack([text[s : s + SEQ + 1] for s in starts.tolist()])
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def base_model() -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(vocab=VOCAB, dim=DIM, heads=HEADS, hidden=HIDDEN, blocks=BLOCKS)


def planned(mesh, sequence_parallel: bool = False) -> TinyLlama:
    model = base_model()
    parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel))
    return model


def split_points(stages: int, blocks: int = BLOCKS) -> tuple[str, ...]:
    """The equal runs of layers ``TinyLlamaStage`` cuts."""
    return tuple(f"layers.{b * blocks // stages}" for b in range(1, stages))


class EagerThreeD:
    """torchtitan's layout, eagerly: the planned model's stage (:class:`TinyLlamaStage`) in a ``PipelineStage`` on
    ``mesh["pp"]`` under torch's ``schedule``; after its step, each shard's gradient (a Partial one, a norm's
    weight under sequence parallel, first reduced over ``tp``) divided by the size of ``dp`` and summed over it
    (what DDP does; DDP itself refuses DTensor parameters; not with ``average=False``, DiLoCo's inner step); then
    AdamW."""

    def __init__(self, model: TinyLlama, mesh, schedule: str, microbatches: int, average: bool = True) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.mesh, self.microbatches, self.average = mesh, microbatches, average
        self.stages, self.index = mesh["pp"].size(), mesh["pp"].get_local_rank()
        self.module = TinyLlamaStage(model, self.index, self.stages)
        stage = PipelineStage(self.module, self.index, self.stages, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, microbatches, loss_fn=loss_fn)
        self.optimizer = adamw(self.module.parameters())

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One step; the mean loss over microbatches on the last stage, None elsewhere."""
        self.optimizer.zero_grad()
        loss = pipelining_step(self.schedule, self.index, self.stages, (inputs, targets), self.microbatches)
        dp, group = self.mesh["dp"].size(), self.mesh["dp"].get_group()
        for p in self.module.parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = p.grad = g.redistribute(g.device_mesh, p.placements)
                g = g.to_local()
            if self.average:
                g.div_(dp)
                dist.all_reduce(g, group=group)
        self.optimizer.step()
        return loss


def single_process(model: torch.nn.Module, every: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[float]:
    """The 1-D run: ``model`` unsplit, in one process, trained on every data-parallel rank's batch at once
    (``every[r][step]``); its loss per step."""
    optimizer = adamw(model.parameters())
    losses = []
    for batch in zip(*every):
        optimizer.zero_grad()
        loss = loss_fn(model(torch.cat([b[0] for b in batch])), torch.cat([b[1] for b in batch]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    torch.set_num_threads(1)
    steps, mode = int(os.environ["BENCH_STEPS"]), os.environ["BENCH_MODE"]
    schedule, m = os.environ["BENCH_SCHEDULE"], int(os.environ["BENCH_MICROBATCHES"])
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("pp", "dp", "tp"))
    text = zen()
    data = batches(text, mesh["dp"].get_local_rank(), steps)
    model = planned(mesh)
    pipeline = PipelineParallel(stages=SHAPE[0], microbatches=m, schedule=schedule, split_points=split_points(SHAPE[0]))
    ours = transpile(model, adamw(model.parameters()), mode, loss_fn, data[0], mesh=mesh["pp", "dp"], pipeline=pipeline)
    eager = EagerThreeD(planned(mesh), mesh, "1f1b" if schedule == "zbh1" else schedule, m)
    runs = {"ours": lambda batch: ours(*batch).item(), "eager": lambda batch: eager(*batch)}
    result: dict = {label: {"losses": [], "ms": []} for label in runs}
    for batch in data:
        for label, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            loss = run(batch)
            result[label]["ms"].append((time.perf_counter() - start) * 1e3)
            result[label]["losses"].append(loss)
    if dist.get_rank() == 0:
        result["1-D"] = single_process(base_model(), [batches(text, r, steps) for r in range(SHAPE[1])])
    result["stage"], result["dp"] = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dist.barrier()
    finish_rank(out, result)


def curves(ranks: list[dict]) -> dict[str, list[float]]:
    """Per step: the 3-D runs' losses on the whole batch (the mean of the last stage's data-parallel ranks'
    means, equal-sized) and the 1-D run's."""
    last = [r for r in ranks if r["stage"] == SHAPE[0] - 1]
    out = {}
    for label in ("ours", "eager"):
        per_dp = {r["dp"]: r[label]["losses"] for r in last}
        out[label] = [sum(step) / len(step) for step in zip(*per_dp.values())]
    out["1-D"] = ranks[0]["1-D"]
    return out


def median_slowest(ranks: list[dict], label: str) -> float:
    return statistics.median(max(step) for step in zip(*(r[label]["ms"] for r in ranks)))


def render(ranks: list[dict], args: argparse.Namespace) -> str:
    c = curves(ranks)
    ours, eager = median_slowest(ranks, "ours"), median_slowest(ranks, "eager")
    off_1d = max(abs(a - b) for a, b in zip(c["ours"], c["1-D"]))
    off_eager = max(abs(a - b) for a, b in zip(c["ours"], c["eager"]))
    peer = " (eager: 1f1b)" if args.schedule == "zbh1" else ""
    return (
        f"`{COMMAND} --steps {args.steps} --mode {args.mode} --schedule {args.schedule} --microbatches "
        f"{args.microbatches}` on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}: dp=2 × pp=2 × tp=2, 8 processes of one thread; TinyLlama {BLOCKS} blocks × width "
        f"{DIM}, {PER_RANK} sequences of {SEQ} characters per dp rank, AdamW; {args.schedule}{peer}, "
        f"{args.microbatches} microbatches; ours `{args.mode}` across dp.\n\n"
        "| run | first loss | last loss | max abs. difference from the 1-D run | step ms (median, slowest rank) |\n"
        "|---|---|---|---|---|\n"
        f"| ours (3-D) | {c['ours'][0]:.4f} | {c['ours'][-1]:.4f} | {off_1d:.2e} | {ours:.1f} |\n"
        f"| eager TP + torch pipelining + averaged over dp | {c['eager'][0]:.4f} | {c['eager'][-1]:.4f} | "
        f"{max(abs(a - b) for a, b in zip(c['eager'], c['1-D'])):.2e} | {eager:.1f} |\n"
        f"| 1-D (one process, whole batch) | {c['1-D'][0]:.4f} | {c['1-D'][-1]:.4f} | 0 | – |\n\n"
        f"Ours against eager: largest loss difference {off_eager:.2e}; step time {ours / eager:.2f}× eager's.\n"
    )


def plot(ranks: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = curves(ranks)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(c["1-D"], label="1-D: one process, whole batch", linewidth=3, alpha=0.4)
    ax.plot(c["ours"], label="3-D: dp2 × pp2 × tp2 (ours)", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (whole batch)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mode", default="zero2", help="the mode across dp")
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "zbh1"))
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    os.environ.update(
        BENCH_STEPS=str(args.steps),
        BENCH_MODE=args.mode,
        BENCH_SCHEDULE=args.schedule,
        BENCH_MICROBATCHES=str(args.microbatches),
    )
    ranks = two_rank_results(__file__, lambda out, _: [out], 29760, world=8)
    table = render(ranks, args)
    print(table)
    write_section(DOC, BEGIN, END, table)
    plot(ranks, FIGURE)


if __name__ == "__main__":
    entry(rank_main, main)
