"""Peak memory against step time under a memory budget: the Pareto front of three ways to recompute.

    python -m bench.memory_budget              # about 15 minutes on 2 cores; writes docs/memory.md's section
    python -m bench.memory_budget --no-compile # without the compiled rows (Inductor's compiles take most of it)

For the bench's GPT and a ResNet-style CNN (``bench/models.py``, AdamW, one process, one thread), in one run:

- ``transpile()`` with ``Execution(memory_budget=b)`` for b in 1.0, 0.7, 0.5, 0.3 and 0 (the least reachable), and
  with ``memory_budget_bytes`` at the peak that checkpointing every block reaches (measured first);
- the same model with ``torch.utils.checkpoint`` around every block, trained eagerly (no checkpoint: eager too);
- ``transpile(..., compile=True)`` at budgets 1 and 0.5 (compiled against compiled), and whether 10 AdamW steps of
  the two end with the same bits;
- ``torch.compile`` of the model with ``torch._functorch.config.activation_memory_budget`` at the same fractions,
  the optimizer eager, each row in a process of its own beside ``transpile`` at budget 1 (its ratio's reference).

Each row gives the measured peak (the profiler's allocation records over one step: what the step allocates beyond
what was held before it, ``transpiler/runtime/allocations.py``), the transpiler's estimate where it has one
(``step.memory_estimate().transient``), the median step time over interleaved rounds, its ratio (the median over
rounds of its time over ``transpile`` at budget 1 in the same round) and the ops one step dispatches. Nothing
here is a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.models import NarrowGPT, NarrowResNet
from bench.op_count import count_ops
from transpiler import ConfigurationError, Execution, NoSync, transpile
from transpiler.runtime.allocations import allocated_peak

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.0)
ROUNDS = 7
BEGIN, END = "<!-- memory budget -->", "<!-- end memory budget -->"
MIB = 1024 * 1024


def models() -> dict[str, tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (8, 129), generator=gen)
    gpt = NarrowGPT(blocks=6, dim=64, heads=4, vocab=256, seq=128)
    cnn = NarrowResNet(blocks=8, channels=16)
    return {
        "gpt": (gpt, (tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous())),
        "cnn": (cnn, (torch.randn(32, 3, 16, 16, generator=gen), torch.randint(0, 10, (32,), generator=gen))),
    }


class PerBlock(nn.Module):
    """``torch.utils.checkpoint`` around each block of ``model.blocks``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def checkpointed(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    model.blocks = nn.Sequential(*(PerBlock(b) for b in model.blocks))
    return model


def eager_step(model: nn.Module, batch: tuple, forward: Callable | None = None) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    loss_fn, run = nn.CrossEntropyLoss(), forward if forward is not None else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(run(batch[0]), batch[1]).backward()
        optimizer.step()

    return step


def compiled_step(model: nn.Module, batch: tuple, budget: float) -> Callable[[], None]:
    """The model compiled under ``activation_memory_budget=budget`` (compiled here, at its first call), in a
    process of its own (:func:`compile_row`): in one process, torch.compile's caches gave every row one budget
    (with ``torch._dynamo.reset()`` between rows, the last row's; without, the first's)."""
    import torch._functorch.config as functorch_config

    torch._inductor.config.fx_graph_cache = False  # a cached compile could carry another budget's partition
    functorch_config.enable_autograd_cache = False
    functorch_config.activation_memory_budget = budget
    step = eager_step(model, batch, torch.compile(model, dynamic=False))
    step()
    return step


def compile_row(name: str, budget: float) -> dict:
    """One torch.compile row, measured in this process beside ``transpile`` at budget 1 (the ratio's reference)."""
    model, batch = models()[name]
    reference, _ = transpiled(model, batch, 1.0)
    rows = {
        "reference": (lambda: reference(*batch), None),
        "compiled": (compiled_step(copy.deepcopy(model), batch, budget), None),
    }
    measured = {r["row"]: r for r in measure(rows, base="reference")}
    return {
        "peak": measured["compiled"]["peak"],
        "ms": measured["compiled"]["ms"],
        "ratio": measured["compiled"]["ratio"],
    }


def compile_rows(name: str) -> list[dict]:
    """The torch.compile rows of ``name``, each from a process of its own (see :func:`compiled_step`)."""
    out = []
    for budget in BUDGETS[:-1]:
        done = subprocess.run(
            [sys.executable, "-m", "bench.memory_budget", "--compile-row", name, str(budget)],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        out.append({"row": f"torch.compile, budget {budget:g}", "estimate": None, "ops": None, **row})
    return out


def transpiled(model: nn.Module, batch: tuple, budget: float | None, compile: bool = False, size: int | None = None):
    """``transpile()`` of ``model`` (NoSync, AdamW) under ``memory_budget=budget`` (or ``memory_budget_bytes=size``),
    run once."""
    model = copy.deepcopy(model)
    step = transpile(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        NoSync(),
        nn.CrossEntropyLoss(),
        batch,
        execution=Execution(memory_budget=budget, memory_budget_bytes=size, compile=compile),
    )
    step(*batch)
    return step, model


def variants(model: nn.Module, batch: tuple, with_compile: bool) -> dict[str, tuple[Callable, int | None]]:
    """Each row's step (warmed up) and the transpiler's estimate of its own tensors' peak (None: no estimate).
    One row's budget is in bytes: the peak checkpointing every block reaches, measured first (the issue's
    comparison: the step's time at that peak)."""
    per_block = eager_step(checkpointed(model), batch)
    per_block()
    out: dict[str, tuple[Callable, int | None]] = {}
    for budget, size in [(b, None) for b in BUDGETS] + [(None, allocated_peak(per_block))]:
        try:
            step, _ = transpiled(model, batch, budget, size=size)
        except ConfigurationError as error:
            print(f"  transpile at budget {budget or size}: {error}", flush=True)
            continue
        named = "per-block's peak" if size else "budget least" if budget == 0 else f"budget {budget:g}"
        out[f"transpile, {named}"] = (lambda s=step: s(*batch), step.memory_estimate().transient)
    for budget in (1.0, 0.5) if with_compile else ():
        try:
            step, _ = transpiled(model, batch, budget, compile=True)
        except ConfigurationError as error:
            print(f"  transpile compile=True at budget {budget}: {error}", flush=True)
            continue
        out[f"transpile compile=True, budget {budget:g}"] = (lambda s=step: s(*batch), None)
    out["eager"] = (eager_step(copy.deepcopy(model), batch), None)
    out["eager, checkpoint per block"] = (per_block, None)
    for step, _ in out.values():
        step()
    return out


def measure(rows: dict[str, tuple[Callable, int | None]], base: str = "transpile, budget 1") -> list[dict]:
    peaks = {name: allocated_peak(step) for name, (step, _) in rows.items()}
    ops = {name: count_ops(step) for name, (step, _) in rows.items() if "compile" not in name}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(ROUNDS):
        for name, (step, _) in rows.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return [
        {
            "row": name,
            "peak": peaks[name],
            "estimate": estimate,
            "ms": statistics.median(times[name]) * 1e3,
            "ratio": statistics.median([t / b for t, b in zip(times[name], times[base])])
            if base in times
            else float("nan"),
            "ops": ops.get(name),
        }
        for name, (_, estimate) in rows.items()
    ]


def table(name: str, rows: list[dict]) -> str:
    lines = [
        f"**{name}**\n",
        "| row | measured peak (MiB) | estimate (MiB) | estimate / measured | step (ms) | × budget 1 | work ops |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        est = f"{r['estimate'] / MIB:.2f}" if r["estimate"] is not None else "–"
        ratio = f"{r['estimate'] / r['peak']:.2f}" if r["estimate"] is not None and r["peak"] else "–"
        ops = r["ops"].work if r["ops"] else "–"
        lines.append(
            f"| {r['row']} | {r['peak'] / MIB:.2f} | {est} | {ratio} | {r['ms']:.1f} | {r['ratio']:.2f} | {ops} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    for ax, (name, rows) in zip(axes, results.items()):
        families = (("transpile,", "o"), ("transpile compile=True", "D"), ("eager", "s"), ("torch.compile", "^"))
        for family, marker in families:
            mine = sorted((r for r in rows if r["row"].startswith(family)), key=lambda r: r["peak"])
            ax.plot([r["peak"] / MIB for r in mine], [r["ms"] for r in mine], marker=marker, label=family)
            for r in mine:
                ax.annotate(r["row"].split(", ")[-1], (r["peak"] / MIB, r["ms"]), fontsize=7)
        ax.set(title=name, xlabel="measured peak of the step (MiB)", ylabel="step time (ms, median)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compiled_parity(model: nn.Module, batch: tuple, steps: int = 10) -> str:
    """``compile=True`` with and without a budget of 0.5: whether 10 AdamW steps end with the same bits."""
    runs = {}
    for budget in (1.0, 0.5):
        step, trained = transpiled(model, batch, budget, compile=True)
        losses = [step(*batch).detach().clone() for _ in range(steps - 1)]
        runs[budget] = (losses, [p.detach().clone() for p in trained.parameters()])
    (la, wa), (lb, wb) = runs[1.0], runs[0.5]
    same = all(map(torch.equal, la, lb)) and all(map(torch.equal, wa, wb))
    return f"compile=True, budget 0.5 against none, {steps} AdamW steps: {'bitwise' if same else 'DIFFERENT'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    parser.add_argument("--compile-row", nargs=2, metavar=("MODEL", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compile_row:  # one torch.compile row, in a process of its own (compile_rows)
        print(json.dumps(compile_row(args.compile_row[0], float(args.compile_row[1]))))
        return
    results, parity = {}, {}
    for name, (model, batch) in models().items():
        print(f"{name}: building the rows", flush=True)
        results[name] = measure(variants(model, batch, not args.no_compile))
        if not args.no_compile:
            results[name] += compile_rows(name)
        print(table(name, results[name]), flush=True)
        if not args.no_compile:
            parity[name] = compiled_parity(model, batch)
            print(parity[name], flush=True)
    plot(results, ROOT / "docs" / "memory_budget.png")
    section = (
        f"{BEGIN}\n## Fitting the step in a memory budget: measured\n\n"
        f"`python -m bench.memory_budget` on {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(one thread), torch {torch.__version__}; medians of {ROUNDS} interleaved rounds.\n\n"
        + "\n".join(table(n, r) + (f"\n{parity[n]}.\n" if n in parity else "") for n, r in results.items())
        + "\n![peak against step time](memory_budget.png)\n"
        + END
    )
    doc = ROOT / "docs" / "memory.md"
    text = doc.read_text()
    start, end = text.find(BEGIN), text.find(END)
    text = (
        text[:start] + section + text[end + len(END) :]
        if start >= 0 and end > start
        else f"{text.rstrip()}\n\n{section}\n"
    )
    doc.write_text(text)
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
