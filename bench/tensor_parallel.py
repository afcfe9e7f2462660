"""Two-dimensional parallelism on the CPU: a Llama-style model under torchtitan's tensor-parallel plan (sequence
parallel) on a ("dp", "tp") mesh of 2 × 2 gloo ranks, the traced step in each mode against the eager runs a user
would pick instead, in one run.

    python -m bench.tensor_parallel                 # timing table, and a 300-step training run of diloco
    python -m bench.tensor_parallel --train 0       # timing only
    python -m bench.tensor_parallel --no-timing --warm 600 --train 300   # DiLoCo from a warmed-up model
    python -m bench.tensor_parallel --compile       # and fused_allreduce with compile=True (Inductor)

Variants: eager TP with each shard's gradient averaged over ``dp`` (one flat all-reduce per step, as DDP would
bucket it: DDP itself refuses DTensor parameters), eager TP with FSDP2 on ``mesh["dp"]`` (every block, then the
root, as torchtitan applies it), and this project's step (``transpile(..., mesh=mesh["dp"])``) in
``fused_allreduce``, ``zero2``, ``zero3`` and ``diloco`` (H=50). All with foreach AdamW. Per variant: the median
step time over interleaved rounds (the slowest rank), the work ops and view ops one step dispatches
(``bench/op_count.py``), each dimension's collectives and the bytes this rank hands them per step (counted as they
are dispatched, each group named by its mesh dimension), the bytes a rank holds between steps (parameters,
gradients, optimizer state; each storage once), and the most a rank holds during a step (those, plus the most the
step allocates above them at once, from the profiler's allocation records).

``--train N``: N steps of ``fused_allreduce`` and of ``diloco`` (H=50, the paper's outer Nesterov SGD) on the
character-level corpus of bench/diloco.py, the held-out loss of each (DiLoCo's on its global weights) after N;
``--warm M``: both start from the weights M steps of ``fused_allreduce`` reached, each with a fresh AdamW, as
bench/diloco.py's runs start from a warmed-up model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.host_ops import interleaved_ms
from bench.models import TinyLlama, llama_tp_plan
from bench.op_count import count_ops
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import DiLoCo, Execution, transpile

ROOT = Path(__file__).resolve().parent.parent

COMMAND = "python -m bench.tensor_parallel"
DOC = ROOT / "docs" / "strategies" / "tensor_parallel.md"
BEGIN, END = "<!-- bench/tensor_parallel.py begin -->", "<!-- bench/tensor_parallel.py end -->"
PER_RANK, SEQ, H = 8, 32, 50
SIZE = {"dim": 64, "heads": 4, "hidden": 128, "blocks": 4}
VARIANTS = ("eager TP, grads averaged", "eager TP + FSDP2", "fused_allreduce", "zero2", "zero3", "diloco")
COMPILED = "fused_allreduce, compile=True"  # with --compile
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d")
COLLECTIVE_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall")


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CollectiveCounter(TorchDispatchMode):
    """Each collective dispatched, by mesh dimension: how many, and the bytes handed to them."""

    def __init__(self, dims: dict[str, str]) -> None:
        super().__init__()
        self.dims, self.calls, self.bytes = dims, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES and any(k in func.__name__ for k in COLLECTIVE_WORDS):
            dim = self.dims.get(group_of(args), "?")
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if torch.is_tensor(t)]
            self.calls[dim] += 1
            self.bytes[dim] += tensors[0].numel() * tensors[0].element_size() if tensors else 0
        return func(*args, **(kwargs or {}))


def step_rise(run: Callable[[], object]) -> int:
    """The most bytes one step holds at once on the CPU above what it held when it began: the profiler's
    allocation records (``profile_memory``) of every tensor allocated and freed during ``run()``, summed in time
    order. CPU tensors have no allocator statistics (``max_memory_allocated`` is CUDA's); the records are read
    from the profiler's raw results (``kineto_results``), as its own per-op memory columns are built."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    live = rise = 0
    for _, nbytes in records:
        live += nbytes
        rise = max(rise, live)
    return rise


def group_of(args: tuple) -> str | None:
    """The group a collective runs on: a functional collective's name (its last string argument), or the name
    of the process group an eager ``c10d`` op takes."""
    from torch._C._distributed_c10d import ProcessGroup

    names = [a for a in args if isinstance(a, str)]
    if names:
        return names[-1]
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).group_name
            except (RuntimeError, TypeError):
                continue
    return None


def build(label: str, base: nn.Module, mesh, batch: tuple) -> tuple[Callable[[], object], Callable[[], int]]:
    """One variant's step on this rank, and what it holds between steps (bytes)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    model = copy.deepcopy(base)
    parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel=True))
    if label in (*VARIANTS[2:], COMPILED):
        mode = label.split(",")[0]
        config = DiLoCo(sync_every=H) if mode == "diloco" else mode
        execution = Execution(compile=label == COMPILED)
        step = transpile(model, adamw(model.parameters()), config, loss_fn, batch, mesh=mesh["dp"], execution=execution)
        return (lambda: step(*batch)), (lambda: step.memory_report().held)
    if label == "eager TP + FSDP2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = adamw(model.parameters())
    group, dp = mesh["dp"].get_group(), mesh["dp"].size()

    def run() -> None:
        optimizer.zero_grad()
        loss_fn(model(batch[0]), batch[1]).backward()
        if label == "eager TP, grads averaged":
            grads = []
            for p in model.parameters():
                if isinstance(p.grad, DTensor):  # a Partial gradient (a norm's weight) summed over tp first
                    p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
            flat = torch._utils._flatten_dense_tensors(grads).div_(dp)
            dist.all_reduce(flat, group=group)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        optimizer.step()

    def held() -> int:
        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        tensors = [local(p) for p in model.parameters()] + [
            local(p.grad) for p in model.parameters() if p.grad is not None
        ]
        tensors += [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    return run, held


def timing(rank: int, mesh, vocab: int, variants: tuple[str, ...]) -> dict:
    torch.manual_seed(0)
    base = TinyLlama(vocab=vocab, **SIZE)
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    tokens = torch.randint(0, vocab, (PER_RANK, SEQ + 1), generator=gen)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    runs, held = {}, {}
    for label in variants:
        runs[label], held[label] = build(label, base, mesh, batch)
    dims = {mesh["tp"].get_group().group_name: "tp", mesh["dp"].get_group().group_name: "dp"}
    result: dict = {"params": sum(p.numel() for p in base.parameters())}
    for label, run in runs.items():
        for _ in range(2):
            run()
        result[label] = {"held": held[label](), "rise": step_rise(run)}
        if label == COMPILED:  # Dynamo refuses a frame run under a dispatch mode, so its ops are not counted
            continue
        ops = count_ops(run)
        with CollectiveCounter(dims) as counter:
            run()
        result[label] |= {
            "work": ops.work,
            "views": ops.views,
            "calls": dict(counter.calls),
            "bytes": dict(counter.bytes),
        }
    times = interleaved_ms(runs)
    for label in runs:
        result[label]["ms"] = times[label]
    return result


def training(mesh, steps: int, warm: int) -> dict:
    """Held-out loss after ``steps`` of fused_allreduce and of diloco on the corpus of bench/diloco.py, both from
    the weights ``warm`` steps of fused_allreduce reached (from scratch when 0), each with a fresh AdamW."""
    from bench.diloco import corpus, windows

    train, held_out, vocab = corpus()
    vocab = -(-vocab // 8) * 8  # a multiple of the tp size, as a plan splits the embedding by rows
    torch.manual_seed(0)
    base = TinyLlama(vocab=vocab, **SIZE)
    eval_batch = windows(held_out, 64, torch.Generator().manual_seed(99))
    dpr = mesh["dp"].get_local_rank()

    def run(label: str, count: int, seed: int, start: dict | None) -> tuple[nn.Module, object]:
        from torch.distributed.tensor.parallel import parallelize_module

        model = copy.deepcopy(base)
        parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel=True))
        gen = torch.Generator().manual_seed(seed + dpr)
        config = DiLoCo(sync_every=H) if label == "diloco" else label
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        step = transpile(model, optimizer, config, loss_fn, windows(train, PER_RANK, gen), mesh=mesh["dp"])
        with torch.no_grad():
            for name, p in model.named_parameters() if start is not None else ():
                p.copy_(start[name])  # this rank's shards of the warmed-up weights, before the first step
        for _ in range(count):
            step(*windows(train, PER_RANK, gen))
        return model, step

    start = None
    if warm:
        model, _ = run("fused_allreduce", warm, 1000, None)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    for label in ("fused_allreduce", "diloco"):
        model, step = run(label, steps, 1, start)
        weights = step.global_weights() if label == "diloco" else step.gathered()
        with weights, torch.no_grad():
            out[label] = float(loss_fn(model(eval_batch[0]), eval_batch[1]))
    return out


def rank_main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    args = json.loads(os.environ["TP_BENCH"])
    variants = tuple(args.get("variants") or ((*VARIANTS, COMPILED) if args["compile"] else VARIANTS))
    result = {"timing": timing(dist.get_rank(), mesh, 256, variants) if args["timing"] else None}
    result["training"] = training(mesh, args["train"], args["warm"]) if args["train"] else None
    finish_rank(out, result)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def render(ranks: list[dict], train_steps: int, warm: int) -> str:
    lines = [
        f"`{COMMAND}` on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 4 gloo ranks "
        f"(dp=2 × tp=2), one thread each, torch {torch.__version__}."
    ]
    timing_ = [r["timing"] for r in ranks]
    if timing_[0] is not None:
        first = timing_[0]
        labels = [label for label in (*VARIANTS, COMPILED) if label in first]
        lines += [
            f"TinyLlama {SIZE} ({first['params']:,} parameters), {PER_RANK}×{SEQ} tokens per dp rank, torchtitan's "
            "plan with sequence parallel, foreach AdamW. Step time: per round the slowest rank's, median over "
            "rounds. Ops, collectives and bytes: rank 0's, per step. Held: rank 0's bytes between steps "
            "(parameters, gradients, optimizer state). Peak: the most any rank holds during a step, its held bytes "
            "plus the most the step allocates above them at once (the profiler's allocation records).",
            "",
            "| variant | step ms | × eager TP + FSDP2 | work ops | view ops | tp collectives (KiB) "
            "| dp collectives (KiB) | held MiB | peak MiB | × eager TP + FSDP2 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        ms = {
            label: statistics.median(max(t[label]["ms"][i] for t in timing_) for i in range(len(first[label]["ms"])))
            for label in labels
        }
        peak = {label: max(t[label]["held"] + t[label]["rise"] for t in timing_) for label in labels}
        for label in labels:
            row = first[label]

            def dim(d: str, row=row) -> str:
                return f"{row['calls'].get(d, 0)} ({row['bytes'].get(d, 0) / 1024:.0f})" if "calls" in row else "—"

            lines.append(
                f"| {label} | {ms[label]:.1f} | {ms[label] / ms['eager TP + FSDP2']:.2f} | {row.get('work', '—')} | "
                f"{row.get('views', '—')} | {dim('tp')} | {dim('dp')} | {mib(row['held'])} | {mib(peak[label])} | "
                f"{peak[label] / peak['eager TP + FSDP2']:.2f} |"
            )
        if COMPILED in labels:
            lines.append(
                f"\n{COMPILED}: its ops and collectives are not counted (the counters are dispatch modes, and Dynamo "
                "refuses to run a compiled frame under one); Inductor compiled it in the first call."
            )
        lines.append("")
    if ranks[0]["training"] is not None:
        t = ranks[0]["training"]
        start = f"from {warm} steps of fused_allreduce" if warm else "from scratch"
        lines.append(
            f"Training, {train_steps} steps on bench/diloco.py's corpus {start}: held-out loss "
            f"{t['fused_allreduce']:.4f} under fused_allreduce, {t['diloco']:.4f} under diloco (H={H}, θ_global): "
            f"{(t['diloco'] / t['fused_allreduce'] - 1) * 100:+.1f}%."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=300, help="training steps of the quality check (0: none)")
    parser.add_argument("--warm", type=int, default=0, help="steps of fused_allreduce both training runs start from")
    parser.add_argument("--no-timing", action="store_true", help="only the training run")
    parser.add_argument("--compile", action="store_true", help=f"a row for {COMPILED} too (about a minute more)")
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    settings = {"timing": not args.no_timing, "train": args.train, "warm": args.warm, "compile": args.compile}
    os.environ["TP_BENCH"] = json.dumps(settings)
    ranks = two_rank_results(__file__, lambda out, _: [out], args.port, world=4)
    text = render(ranks, args.train, args.warm)
    print(text)
    if not args.no_timing and args.train:
        write_section(DOC, BEGIN, END, text)


if __name__ == "__main__":
    entry(rank_main, main)
