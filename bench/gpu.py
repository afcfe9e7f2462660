"""Step time on one GPU: eager, DDP, the transpiled step, captured, compiled, in a world of one (issue 17).

    PYTHONPATH=$PWD python3 -m bench.gpu [--models mlp,resnet50,gpt2] [--compile] [--out docs/gpu_bench.md]

One process, a world of one over NCCL (gloo on a machine without CUDA, for a dry run at small sizes). bf16
autocast around the forward and the loss for eager and DDP, and around the whole step for ours, as users
write it. The variants take turns within each round (5 rounds of 5 timed steps after 3 warm-ups), and each
figure is the median over rounds of CUDA-event time per step. Kernels and device time per step come from
``torch.profiler`` over 3 steps; peak memory is ``max_memory_allocated`` over one step, from a reset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from transpiler import Execution, transpile
from transpiler.planner.programs import profile_kernels

ROUNDS, STEPS, WARMUP, PROFILED = 5, 5, 3, 3


def workload(name: str, cuda: bool) -> tuple[nn.Module, tuple, Callable, Callable]:
    """Model, batch, loss function and optimizer factory; full sizes on a GPU, small ones for a CPU dry run."""
    gen = torch.Generator().manual_seed(0)
    if name == "mlp":  # launch-bound: many small kernels
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))
        batch = (torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen))
        return model, batch, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)
    if name == "resnet50":
        import torchvision

        n, side = (64, 224) if cuda else (2, 64)
        batch = (torch.randn(n, 3, side, side, generator=gen), torch.randint(0, 1000, (n,), generator=gen))
        sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
        return torchvision.models.resnet50(), batch, nn.CrossEntropyLoss(), sgd
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config() if cuda else GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500)
        shape = (8, 512) if cuda else (2, 32)
        ids = torch.randint(0, config.vocab_size, shape, generator=gen)

        class LM(nn.Module):  # the model returns its own loss
            def __init__(self):
                super().__init__()
                self.inner = GPT2LMHeadModel(config)

            def forward(self, tokens):
                return self.inner(input_ids=tokens, labels=tokens, use_cache=False).loss

        adamw = lambda p: torch.optim.AdamW(p, lr=1e-4)  # noqa: E731 (torch's default: foreach on CUDA)
        return LM(), (ids,), None, adamw
    raise SystemExit(f"unknown model '{name}': choose from mlp, resnet50, gpt2")


def variants(name: str, device: torch.device, compile_: bool) -> dict[str, Callable[[], object]]:
    """One step per call, each variant on its own copy of the model."""
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    out: dict[str, Callable[[], object]] = {}
    model, batch, loss_fn, make_opt = workload(name, cuda)
    batch = tuple(t.to(device) for t in batch)
    compute = (lambda m, b: m(*b)) if loss_fn is None else (lambda m, b: loss_fn(m(*b[:-1]), b[-1]))

    def eager_like(module: nn.Module) -> Callable[[], object]:
        opt = make_opt(module.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = compute(module, batch)
            loss.backward()
            opt.step()

        return step

    out["eager"] = eager_like(model.to(device))
    out["DDP"] = eager_like(DDP(workload(name, cuda)[0].to(device)))
    modes = {"fused": {}, **({"captured": {"cuda_graph": True}} if cuda else {})}
    if compile_:
        modes |= {
            "compiled": {"compile": True},
            **({"compiled+captured": {"compile": True, "cuda_graph": True}} if cuda else {}),
        }
    for label, options in modes.items():
        mine = workload(name, cuda)[0].to(device)
        step = transpile(mine, make_opt(mine.parameters()), "fused_allreduce", loss_fn, execution=Execution(**options))

        def run(step=step):
            with autocast:
                step(*batch)

        start = time.perf_counter()
        run()  # trace (and compile) outside the timing
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(2):  # with cuda_graph=True: the second warm-up, then the capture and first replay
            run()
        torch.cuda.synchronize() if cuda else None
        print(f"  {name} {label}: first call {first:.1f} s, next two {time.perf_counter() - start:.2f} s", flush=True)
        run.runners = step._state.built.runners
        run.transpiled = step
        out[label] = run
    return out


def timed(steps: dict[str, Callable], device: torch.device) -> dict[str, float]:
    """Median milliseconds per step, the variants taking turns within each round."""
    return {label: statistics.median(t) for label, t in timed_rounds(steps, device).items()}


def timed_rounds(steps: dict[str, Callable], device: torch.device, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Milliseconds per step of each variant in each round, the variants taking turns within a round."""
    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            for _ in range(WARMUP):
                step()
            torch.cuda.synchronize() if cuda else None
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize() if cuda else None
            times[label].append((time.perf_counter() - start) / STEPS * 1e3)
    return times


def profiled(step: Callable, device: torch.device) -> tuple[float, float]:
    """Kernels and device milliseconds per step (0, 0 without CUDA)."""
    if device.type != "cuda":
        return 0.0, 0.0
    kernels, seconds = profile_kernels(step, PROFILED)
    return kernels, seconds * 1e3


def peak_mib(step: Callable, device: torch.device) -> float:
    """Peak allocated bytes over one step. A captured step allocates nothing when it replays: its workspace
    is its graphs' private pool, counted whole (reserved, not only what the replay uses) on top of what is
    allocated outside the pool."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    pools = {tuple(r.pool) for r in getattr(step, "runners", {}).values() if hasattr(r, "pool")}
    if not pools:
        return torch.cuda.max_memory_allocated() / 2**20
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) in pools]
    outside = torch.cuda.max_memory_allocated() - sum(s["allocated_size"] for s in segments)
    return (outside + sum(s["total_size"] for s in segments)) / 2**20


def world_of_one(port: int) -> torch.device:
    """This process as a world of one: over NCCL on the first GPU, or over gloo on the CPU (a dry run)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, timeout=timedelta(seconds=300))
    return device


def session(port: int) -> tuple[torch.device, str]:
    """This process as a world of one (TF32 matmuls on a GPU): the device, and the report's first line."""
    device = world_of_one(port)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run, small sizes)"
    return device, f"Device: {name}; torch {torch.__version__}; bf16 autocast; world of one over {dist.get_backend()}."


def finish(report: str, out: str | None) -> None:
    """Print the report, write it to ``out`` too, and leave the world."""
    print("\n" + report)
    if out:
        Path(out).write_text(report + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50,gpt2")
    parser.add_argument("--compile", action="store_true", help="also time compile=True, uncaptured and captured")
    parser.add_argument("--out", default=None, help="write the markdown table there too")
    args = parser.parse_args()
    device, header = session(29517)
    lines = [
        header,
        "",
        "| model | variant | ms/step (median) | × DDP | × eager | kernels/step | device ms/step | peak MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model_name in args.models.split(","):
        steps = variants(model_name, device, args.compile)
        ms = timed(steps, device)
        for label, step in steps.items():
            kernels, device_ms = profiled(step, device)
            lines.append(
                f"| {model_name} | {label} | {ms[label]:.2f} | {ms[label] / ms['DDP']:.2f} | "
                f"{ms[label] / ms['eager']:.2f} | {kernels:.0f} | {device_ms:.2f} | {peak_mib(step, device):.0f} |"
            )
        print("\n".join(lines[-len(steps) :]), flush=True)
    finish("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
