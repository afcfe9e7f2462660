"""ZeRO-3 against FSDP2, the wrapper a user would pick instead, against DDP and against the serial limit, in one run
per world size.

    python -m bench.fsdp                # worlds of 2 and 4 over gloo; writes docs/strategies/zero.md's section
    python -m bench.fsdp --worlds 2     # one world size
    PYTHONPATH=$PWD python3 -m bench.fsdp --device cuda --out fsdp_gpu.md   # one GPU, a world of one over NCCL

FSDP2 is applied as torchtitan applies it: ``fully_shard`` on every block, then on the root, with foreach AdamW,
once with ``reshard_after_forward=True`` (its default) and once with ``False``. ``zero3`` runs with its defaults
and with ``reshard_after_forward=False``; ``zero2`` (whole parameters, sharded state and gradients) beside them.
DDP (foreach AdamW, gradients as bucket views) is the replicated reference. Per variant: the median step time over
interleaved rounds (the slowest rank), the work ops and view ops one step dispatches and its all-gathers and
reduce-scatters (``bench/op_count.py``), and the bytes a rank holds between steps: its parameters (local shards),
gradients (``.grad`` as left by the step; DDP's are views of its buckets) and optimizer state, each storage once;
for ours ``step.memory_report().held``. The serial limit is this rank's step with no communication (the same
traced forward and backward, the update on flat buffers: ``LOCAL``) plus the least any ZeRO-3 must move, each
timed in the same run: one all-gather of all the parameters and one reduce-scatter of all the gradients, one flat
collective each (the reduce-scatter as ``zero3`` runs it on gloo: an all-to-all and a local sum, which gloo's own
``reduce_scatter_tensor`` takes longer to do). After the timed steps every variant has taken the same steps from
the same weights: the text gives the largest difference between ``zero3``'s parameters and FSDP2's (0: the same
bits), and DDP's beside it (at W=4 the sums run in another order, and ~100 AdamW steps on one batch carry that
far).

``--device cuda`` is the single-device variant: one process, a world of one over NCCL (gloo on a machine without
CUDA, a dry run), the same variants with plain eager AdamW (no wrapper) in place of the serial limit, and a
larger GPT beside the narrow ones. Per variant: the median step time (CUDA-synchronised, interleaved), kernels and
device time per step (``torch.profiler``), and the device memory the variant takes at its peak: ``max_memory_allocated``
over its third step, less what the variants built before it hold, with the bytes it holds between steps beside it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import statistics
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.host_ops import ROUNDS, STEPS, interleaved_ms
from bench.models import NarrowGPT, NarrowResNet, narrow_batch
from bench.op_count import count_ops
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import mode_config, transpile

ROOT = Path(__file__).resolve().parent.parent

COMMAND = "python -m bench.fsdp"
PER_RANK = 4
MODELS: dict[str, tuple[str, str, Callable[[], nn.Module]]] = {  # key -> (title, batch kind, model)
    "narrow": ("narrow GPT (12 blocks, d=16)", "gpt", lambda: NarrowGPT()),
    "wide": ("wide GPT (4 blocks, d=256)", "gpt", lambda: NarrowGPT(blocks=4, dim=256, heads=4)),
    "cnn": ("narrow CNN (16 residual blocks of 8 channels, BatchNorm)", "cnn", lambda: NarrowResNet()),
}
LIMIT = "serial limit"
LOCAL = "flatten-update,foreach-update,reinplace-optimizer"  # the step alone, with the fewest update ops
NO_RESHARD = ", no reshard"  # reshard_after_forward=False
VARIANTS = ("DDP", "FSDP2", "FSDP2" + NO_RESHARD, "zero3", "zero3" + NO_RESHARD, "zero2", LIMIT)
EAGER = "eager, no wrapper"
DEVICE_MODELS = {**MODELS, "large": ("GPT (8 blocks, d=1024)", "gpt", lambda: NarrowGPT(blocks=8, dim=1024, heads=16))}
DEVICE_VARIANTS = (EAGER,) + VARIANTS[:-1]
DOC = ROOT / "docs" / "strategies" / "zero.md"
BEGIN, END = "<!-- fsdp -->", "<!-- /fsdp -->"


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def eager_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> Callable[[], None]:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(batch[0]), batch[1]).backward()
        optimizer.step()

    return step


def fsdp2(model: nn.Module, reshard: bool) -> nn.Module:
    """torchtitan's wrapping: every block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = ()) -> int:
    """Bytes an eager model and its optimizer hold between steps: parameters, gradients and optimizer state (this
    rank's shards), and ``extra`` (what a training loop keeps besides: saved weights, an outer optimizer's state),
    each storage once; of a wrapping optimizer (``PostLocalSGDOptimizer``, ``ZeroRedundancyOptimizer``), the state
    of the one it wraps (``optim``)."""
    params = list(model.parameters())
    tensors = [local(p) for p in params] + [local(p.grad) for p in params if p.grad is not None]
    state = getattr(optimizer, "optim", optimizer).state
    tensors += [local(v) for s in state.values() for v in s.values() if torch.is_tensor(v)]
    tensors += [local(t) for t in extra]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class Variant:
    """One variant's step on this rank, what it holds between steps, and its parameters whole afterwards."""

    def __init__(self, label: str, base: nn.Module, batch: tuple, device: str = "cpu"):
        model = copy.deepcopy(base).to(device)
        self.model, self.transpiled, self.optimizer = model, None, None
        if label == EAGER:
            self.optimizer = adamw(model.parameters())
            self.run = eager_step(model, self.optimizer, batch)
        elif label == "DDP":
            ddp = DDP(model, gradient_as_bucket_view=True)
            self.optimizer = adamw(ddp.parameters())
            self.run = eager_step(ddp, self.optimizer, batch)
        elif label.startswith("FSDP2"):
            wrapped = fsdp2(model, reshard=NO_RESHARD not in label)
            self.optimizer = adamw(model.parameters())
            self.run = eager_step(wrapped, self.optimizer, batch)
        elif label == LIMIT:
            self.run = self._limit(model, batch)
        else:
            mode, options = label.split(",")[0], {"reshard_after_forward": False} if NO_RESHARD in label else {}
            loss_fn = nn.CrossEntropyLoss()
            self.transpiled = transpile(model, adamw(model.parameters()), mode_config(mode, **options), loss_fn, batch)
            self.run = lambda: self.transpiled(*batch)

    @staticmethod
    def _limit(model: nn.Module, batch: tuple) -> Callable[[], None]:
        """No communication in the step, then the least bytes ZeRO-3 moves, as two flat collectives (the
        reduce-scatter as an all-to-all and a local sum, zero3's form on gloo)."""
        alone = transpile(model, adamw(model.parameters()), LOCAL, nn.CrossEntropyLoss(), batch)
        world = dist.get_world_size()
        numel = -(-sum(p.numel() for p in model.parameters()) // world) * world
        whole, shard, received = torch.zeros(numel), torch.zeros(numel // world), torch.zeros(numel)

        def run() -> None:
            alone(*batch)
            dist.all_gather_into_tensor(whole, shard)
            dist.all_to_all_single(received, whole)
            torch.sum(received.view(world, -1), 0, out=shard)

        return run

    def held_bytes(self) -> int | None:
        """Bytes held between steps: parameters, gradients and optimizer state, each storage once (None for the
        serial limit, which holds the local step's state and no shards)."""
        if self.transpiled is not None:
            return self.transpiled.memory_report().held
        if self.optimizer is None:
            return None
        return held_bytes(self.model, self.optimizer)

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
        "scatters": sum(n for name, n in names if any(k in name for k in ("reduce_scatter", "all_to_all", "alltoall"))),
    }


def largest_gap(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return max((ours[n].double() - theirs[n].double()).abs().max().item() for n in ours)


def worker(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result: dict[str, dict] = {}
    for key, (_, kind, make) in MODELS.items():
        torch.manual_seed(0)
        base = make()
        batch = narrow_batch(kind, PER_RANK, torch.Generator().manual_seed(rank))
        variants = {label: Variant(label, base, batch) for label in VARIANTS}
        counts = {}
        for label, variant in variants.items():
            variant.run()
            counter = count_ops(variant.run)
            counts[label] = {"work": counter.work, "views": counter.views, **collectives(counter)}
        times = interleaved_ms({label: variant.run for label, variant in variants.items()})
        theirs = variants["FSDP2"].parameters()
        gap = {label: largest_gap(variants[label].parameters(), theirs) for label in ("zero3", "DDP")}
        result[key] = {
            "counts": counts,
            "ms": {label: statistics.median(t) for label, t in times.items()},
            "held": {label: variant.held_bytes() for label, variant in variants.items()},
            "gap": gap,
            "decision": variants["zero3"].transpiled.program.decisions.get("shard-optimizer", ""),
        }
    finish_rank(out, result)


def render(worlds: dict[int, list[dict]]) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"`{COMMAND}` (gloo, one thread per rank, AdamW, {PER_RANK} samples per rank, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, {cpu}; step ms: median over {ROUNDS} rounds of {STEPS} steps, the slowest rank; "
        "ops and collectives: one step, rank 0; held: bytes rank 0 holds between steps):",
        "",
    ]
    for world, ranks in worlds.items():
        for key, (title, _, _) in MODELS.items():
            first = ranks[0][key]
            ms = {label: max(r[key]["ms"][label] for r in ranks) for label in VARIANTS}
            gap = {label: max(r[key]["gap"][label] for r in ranks) for label in ("zero3", "DDP")}
            said = {label: "bit for bit" if g == 0 else f"within {g:.2g}" for label, g in gap.items()}
            lines += [
                f"**W={world}, {title}**: zero3 chose {first['decision'] or 'its caps as given'}. After the same steps "
                f"its parameters are FSDP2's {said['zero3']} (DDP's: {said['DDP']}).",
                "",
                "| variant | step ms | × FSDP2 | work ops | × FSDP2 | views | all-gathers | reduce-scatters "
                "| held KiB | × FSDP2 |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            held_fsdp = first["held"]["FSDP2"]
            for label in VARIANTS:
                c, held = first["counts"][label], first["held"][label]
                held_cells = f"{held / 1024:.0f} | {held / held_fsdp:.2f}" if held is not None else "– | –"
                lines.append(
                    f"| {label} | {ms[label]:.1f} | {ms[label] / ms['FSDP2']:.2f} | {c['work']} | "
                    f"{c['work'] / first['counts']['FSDP2']['work']:.2f} | {c['views']} | {c['gathers']} | "
                    f"{c['scatters']} | {held_cells} |"
                )
            lines.append("")
    return "\n".join(lines)


def built_on_device(label: str, base: nn.Module, batch: tuple, device: torch.device) -> tuple[Variant, float]:
    """The variant built on ``device`` and run twice, with the MiB it takes at its peak during a third step: the
    peak allocated less what the variants built before it hold (0 without CUDA)."""
    cuda = device.type == "cuda"
    gc.collect()  # the last model's variants, held in cycles, freed now rather than while this one is built
    others = torch.cuda.memory_allocated() if cuda else 0
    variant = Variant(label, base, batch, device.type)
    for _ in range(2):
        variant.run()
    if not cuda:
        return variant, 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    variant.run()
    torch.cuda.synchronize()
    return variant, (torch.cuda.max_memory_allocated() - others) / 2**20


def host_profile(label: str, run: Callable[[], None]) -> str:
    """Where one variant's host time goes: torch.profiler's ops by self CPU time over 3 steps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            run()
    return f"{label}:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)


def single_device(models: list[str], out: str | None, profile: bool) -> None:
    """The variants in a world of one on this process's device, written as a markdown table (with ``profile``,
    the host profile of zero3 and FSDP2 on the first model after it)."""
    from bench.gpu import profiled, timed, world_of_one

    device = world_of_one(29593)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "CPU (dry run)"
    lines = [
        f"`{COMMAND} --device cuda` ({name}, torch {torch.__version__}, a world of one over {dist.get_backend()}, "
        f"fp32, AdamW, {PER_RANK * 8} samples; step ms: median over rounds, variants interleaved; kernels and device "
        "ms: per step, torch.profiler; peak MiB: max_memory_allocated over the variant's third step, less the "
        "other variants' bytes; "
        "held: bytes held between steps):",
        "",
    ]
    for title, kind, make in (DEVICE_MODELS[m] for m in models):
        torch.manual_seed(0)
        base = make()
        batch = tuple(t.to(device) for t in narrow_batch(kind, PER_RANK * 8, torch.Generator().manual_seed(0)))
        built = {label: built_on_device(label, base, batch, device) for label in DEVICE_VARIANTS}
        variants, peak = {k: v for k, (v, _) in built.items()}, {k: mib for k, (_, mib) in built.items()}
        ms = timed({label: v.run for label, v in variants.items()}, device)
        theirs = variants["FSDP2"].parameters()
        gap = {label: largest_gap(variants[label].parameters(), theirs) for label in ("zero3", "DDP")}
        said = {label: "bit for bit" if g == 0 else f"within {g:.2g}" for label, g in gap.items()}
        lines += [
            f"**{title}**: zero3 chose {variants['zero3'].transpiled.program.decisions.get('shard-optimizer', '')}. "
            f"After the same steps its parameters are FSDP2's {said['zero3']} (DDP's: {said['DDP']}).",
            "",
            "| variant | step ms | × FSDP2 | kernels | × FSDP2 | device ms | peak MiB | × FSDP2 | held MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        kernels = {label: profiled(v.run, device) for label, v in variants.items()}
        for label, variant in variants.items():
            k, dev_ms = kernels[label]
            lines.append(
                f"| {label} | {ms[label]:.2f} | {ms[label] / ms['FSDP2']:.2f} | {k:.0f} | "
                f"{k / max(kernels['FSDP2'][0], 1):.2f} | {dev_ms:.2f} | {peak[label]:.0f} | "
                f"{peak[label] / max(peak['FSDP2'], 1e-9):.2f} | {variant.held_bytes() / 2**20:.1f} |"
            )
        lines.append("")
        print("\n".join(lines[-len(variants) - 5 :]), flush=True)
        if profile:
            print("\n".join(host_profile(label, variants[label].run) for label in ("zero3", "FSDP2")), flush=True)
            profile = False
        del variants, built
        torch.cuda.empty_cache() if cuda else None
    body = "\n".join(lines)
    if out:
        Path(out).write_text(body + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--device", choices=["cuda"], help="the single-device variant, a world of one")
    parser.add_argument("--out", help="with --device: write the table there too")
    parser.add_argument("--profile", action="store_true", help="with --device: zero3's and FSDP2's host profile")
    parser.add_argument("--models", nargs="+", choices=list(DEVICE_MODELS), default=list(DEVICE_MODELS))
    args = parser.parse_args()
    if args.device:
        single_device(args.models, args.out, args.profile)
        return
    worlds = {w: two_rank_results(__file__, lambda out, _: [out], port=29591, world=w) for w in args.worlds}
    body = render(worlds)
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    entry(worker, main)
