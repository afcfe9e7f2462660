"""ZeRO-3 against FSDP2, the wrapper a user would pick instead, and against the serial limit, in one run.

    python bench/fsdp2.py           # 2 processes over gloo; writes docs/strategies/zero.md's fsdp2 section

FSDP2 is applied as torchtitan applies it: ``fully_shard`` on every block, then on the root
(``reshard_after_forward=True``), with foreach AdamW. ``zero3`` runs with its defaults and with the cap it used
before issue 42 (``bucket_cap_mb="layer"``). DDP (foreach AdamW) is the replicated reference. Per variant: the
median step time over interleaved rounds (the slower rank), the work ops and the all-gathers and reduce-scatters
one step dispatches (``bench/op_count.py``). The serial limit is this rank's step with no communication (the
same traced forward and backward, the update on flat buffers: ``LOCAL``) plus what ZeRO-3 must move, each timed
in the same run: two all-gathers of all the parameters (forward and backward) and one reduce-scatter of all the
gradients, one flat collective each. After the timed steps every variant has taken the same steps from the
same weights: the table says whether ``zero3``'s parameters are FSDP2's, bit for bit.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.host_ops import ROUNDS, STEPS, interleaved_ms  # noqa: E402
from bench.models import NarrowGPT, narrow_batch  # noqa: E402
from bench.op_count import count_ops  # noqa: E402
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section  # noqa: E402
from transpiler import transpile  # noqa: E402

COMMAND = "python bench/fsdp2.py"
PER_RANK = 4
MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "narrow": ("narrow GPT (12 blocks, d=16)", lambda: NarrowGPT()),
    "wide": ("wide GPT (4 blocks, d=256)", lambda: NarrowGPT(blocks=4, dim=256, heads=4)),
}
LIMIT = "serial limit"
LOCAL = "flatten-update,foreach-update,reinplace-optimizer"  # the step alone, with the fewest update ops
VARIANTS = ("DDP", "FSDP2", "zero3", 'zero3, bucket_cap_mb="layer"', LIMIT)
DOC = ROOT / "docs" / "strategies" / "zero.md"
BEGIN, END = "<!-- fsdp2 -->", "<!-- /fsdp2 -->"


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def eager_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> Callable[[], None]:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(batch[0]), batch[1]).backward()
        optimizer.step()

    return step


def fsdp2(model: nn.Module) -> nn.Module:
    """torchtitan's wrapping: every block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True)


class Variant:
    """One variant's step on this rank and a way to read its parameters whole afterwards."""

    def __init__(self, label: str, base: nn.Module, batch: tuple):
        model = copy.deepcopy(base)
        self.model, self.transpiled = model, None
        if label == "DDP":
            ddp = DDP(model)
            self.run = eager_step(ddp, adamw(ddp.parameters()), batch)
        elif label == "FSDP2":
            self.run = eager_step(fsdp2(model), adamw(model.parameters()), batch)
        elif label == LIMIT:
            self.run = self._limit(model, batch)
        else:
            options = {"bucket_cap_mb": "layer"} if "layer" in label else {}
            loss_fn = nn.CrossEntropyLoss()
            self.transpiled = transpile(model, adamw(model.parameters()), "zero3", loss_fn, batch, **options)
            self.run = lambda: self.transpiled(*batch)

    @staticmethod
    def _limit(model: nn.Module, batch: tuple) -> Callable[[], None]:
        """No communication in the step, then the bytes ZeRO-3 moves as three flat collectives."""
        local = transpile(model, adamw(model.parameters()), LOCAL, nn.CrossEntropyLoss(), batch)
        world = dist.get_world_size()
        numel = -(-sum(p.numel() for p in model.parameters()) // world) * world
        whole, shard = torch.zeros(numel), torch.zeros(numel // world)

        def run() -> None:
            local(*batch)
            for _ in range(2):
                dist.all_gather_into_tensor(whole, shard)
            dist.reduce_scatter_tensor(shard, whole)

        return run

    def parameters(self) -> dict[str, torch.Tensor]:
        """The parameters whole (FSDP2's DTensors gathered, zero3's inside ``gathered()``)."""
        if self.transpiled is not None:
            with self.transpiled.gathered():
                return {n: p.detach().clone() for n, p in self.model.named_parameters()}
        out = {}
        for name, p in self.model.named_parameters():
            value = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.removeprefix("module.")] = value.detach().clone()
        return out


def collectives(counter) -> dict[str, int]:
    """All-gathers and reduce-scatters among the ops counted: functional (``_c10d_functional``) or eager
    (``c10d``); on the CPU zero3's reduce-scatter is an all-to-all and a local sum (``shard_optimizer.py``)."""
    names = [(str(func).split(".")[1] if "." in str(func) else str(func), n) for func, n in counter.counts.items()]
    return {
        "gathers": sum(n for name, n in names if "all_gather" in name or "allgather" in name),
        "scatters": sum(n for name, n in names if "reduce_scatter" in name or "all_to_all" in name),
    }


def worker(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result: dict[str, dict] = {}
    for key, (_, make) in MODELS.items():
        torch.manual_seed(0)
        base = make()
        batch = narrow_batch("gpt", PER_RANK, torch.Generator().manual_seed(rank))
        variants = {label: Variant(label, base, batch) for label in VARIANTS}
        counts = {}
        for label, variant in variants.items():
            variant.run()
            counter = count_ops(variant.run)
            counts[label] = {"work": counter.work, **collectives(counter)}
        times = interleaved_ms({label: variant.run for label, variant in variants.items()})
        ours, theirs = variants["zero3"].parameters(), variants["FSDP2"].parameters()
        same = ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
        decisions = variants["zero3"].transpiled.program.decisions.get("shard-optimizer", "")
        ms = {label: statistics.median(t) for label, t in times.items()}
        result[key] = {"counts": counts, "ms": ms, "same_bits": same, "decision": decisions}
    finish_rank(out, result)


def render(ranks: list[dict]) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"`{COMMAND}` (W=2 over gloo, one thread per rank, AdamW, {PER_RANK} sequences of 16 tokens per rank, "
        f"torch {torch.__version__}, {os.cpu_count()} cores, {cpu}; step ms: median over {ROUNDS} rounds of "
        f"{STEPS} steps, the slower rank; ops: one step, rank 0):",
        "",
    ]
    for key, (title, _) in MODELS.items():
        first = ranks[0][key]
        ms = {label: max(r[key]["ms"][label] for r in ranks) for label in VARIANTS}
        lines += [
            f"**{title}**: zero3 chose {first['decision'] or 'its caps as given'}; after the same steps its "
            f"parameters are FSDP2's bit for bit: **{'yes' if all(r[key]['same_bits'] for r in ranks) else 'no'}**.",
            "",
            "| variant | step ms | × FSDP2 | work ops | × FSDP2 | all-gathers | reduce-scatters |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for label in VARIANTS:
            c = first["counts"][label]
            lines.append(
                f"| {label} | {ms[label]:.1f} | {ms[label] / ms['FSDP2']:.2f} | {c['work']} | "
                f"{c['work'] / first['counts']['FSDP2']['work']:.2f} | {c['gathers']} | {c['scatters']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    body = render(two_rank_results(__file__, lambda out, _: [out], port=29591))
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    entry(worker, main)
