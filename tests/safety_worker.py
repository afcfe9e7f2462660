"""One rank of the multi-rank safety runs (launched by tests/test_safety_world.py).

``world`` scenarios share one healthy process group: ranks started with other
settings (each must raise RankMismatchError on every rank, quickly, leaving the
group usable), then parity against DDP for models that failed before (LSTM,
GRU, checkpointing with dropout, Embedding max_norm, train/eval switches,
tiny Hugging Face GPT-2 and Llama), a consistent mid-run freeze, a
checkpoint restored per rank, and the timeouts of the groups a step uses. ``stall``, ``freeze_one``, ``die`` and
``stall_in_save`` (rank 1 stops between a checkpointer's barrier and its DCP save) each
break the group on purpose, so each runs in a world of its own with a 3 s
timeout. Every rank saves what it saw: errors with their messages and how
long it took to fail, and parameters to compare.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, make_batch, make_model, tiny_gpt2, tiny_llama  # noqa: E402
from transpiler import Checkpointer, DataParallel, Execution, TranspilerError, mode_config, transpile  # noqa: E402
from transpiler.runtime.process_group import live_group  # noqa: E402

LOSS = nn.CrossEntropyLoss()
PER_RANK = 4
SHORT = 3.0  # seconds: the timeout of the fault worlds


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def expect_error(fn) -> dict:
    """Run fn; record the error it raises (type, message, seconds to fail), or that it did not raise."""
    start = time.perf_counter()
    try:
        fn()
    except TranspilerError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    return {"type": None, "message": "no error", "seconds": time.perf_counter() - start}


def mismatches(rank: int) -> dict:
    batch = make_batch("mlp", PER_RANK, torch.Generator().manual_seed(rank))
    cases = {
        "k_steps": ("local_sgd", {"k_steps": 2 + rank}, MLP),
        "bucket_cap": ("fused_allreduce", {"bucket_cap_mb": 25.0 if rank == 0 else 0.001}, MLP),
        "mode": ("fused_allreduce" if rank == 0 else "allreduce", {}, MLP),
        "hidden_size": ("fused_allreduce", {}, lambda: MLP(hidden=32 + 8 * rank)),
        "extra_layer": ("fused_allreduce", {}, lambda: nn.Sequential(MLP(), *[nn.Linear(5, 5)] * rank)),
        "eval_on_one_rank": ("fused_allreduce", {}, lambda: MLP().train(rank == 0)),
    }
    out = {}
    for name, (mode, options, make) in cases.items():
        model = make()
        step = transpile(model, sgd(model.parameters()), mode_config(mode, **options), loss_fn=LOSS)
        out[name] = expect_error(lambda step=step: step(*batch))
    return out


def seeded(fn, seed: int):
    torch.manual_seed(seed)
    return fn()


def parity(name: str, rank: int, world: int, steps: int = 4, switch_modes: bool = False) -> dict:
    """Transpiled (fused_allreduce) against DDP on the same shards and the same dropout seeds."""
    torch.manual_seed(0)
    base = make_model(name) if isinstance(name, str) and name in MODEL_NAMES else HF[name]()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    trainable = [p for p in ours.parameters() if p.requires_grad]
    opt, ddp = sgd(trainable), DDP(theirs, broadcast_buffers=False)  # buffers stay local, as in our modes
    ddp_opt = sgd([p for p in ddp.parameters() if p.requires_grad])
    hf = name in HF
    step = transpile(ours, opt, DataParallel(bucket_cap_mb=0.01, first_bucket_mb=0.005), loss_fn=None if hf else LOSS)
    gen = torch.Generator().manual_seed(7)
    record = []
    for i in range(steps):
        x, y = make_batch("tied" if hf else name, PER_RANK * world, gen)
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        batch = (x[shard] % 100,) if hf else (x[shard], y[shard])
        if switch_modes and i == 2:
            ours.eval(), ddp.eval()
        seeded(lambda batch=batch: step(*batch), 1000 * rank + i)

        def ddp_step(batch=batch):
            ddp_opt.zero_grad()
            out = ddp(*batch[:1]) if hf else LOSS(ddp(batch[0]), batch[1])
            out.backward()
            ddp_opt.step()

        seeded(ddp_step, 1000 * rank + i)
        record.append(
            (
                {n: t.detach().clone() for n, t in ours.state_dict().items()},
                {n: t.detach().clone() for n, t in ddp.module.state_dict().items()},
            )
        )
    return {"steps": record, "traces": step.traces, "handshakes": step._startup.handshake.rounds}


MODEL_NAMES = ("lstm", "gru", "checkpoint", "maxnorm", "dropout_bn")


HF = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def consistent_freeze(rank: int) -> dict:
    """Every rank freezes the same layer mid-run: one new handshake, and the frozen layer stays put."""
    torch.manual_seed(0)
    model = MLP()
    step = transpile(model, sgd(model.parameters()), loss_fn=LOSS)
    gen = torch.Generator().manual_seed(rank)
    step(*make_batch("mlp", PER_RANK, gen))
    model.net[0].requires_grad_(False)
    frozen = model.net[0].weight.detach().clone()
    for _ in range(2):
        step(*make_batch("mlp", PER_RANK, gen))
    return {"unchanged": torch.equal(frozen, model.net[0].weight), "handshakes": step._startup.handshake.rounds}


def restore_per_rank(rank: int) -> dict:
    """BatchNorm statistics differ per rank; a per-rank checkpoint restores them exactly, with no broadcast."""
    torch.manual_seed(0)
    model = make_model("dropout_bn")
    step = transpile(model, sgd(model.parameters()), loss_fn=LOSS)
    gen = torch.Generator().manual_seed(11 + rank)
    for i in range(2):
        seeded(lambda: step(*make_batch("mlp", PER_RANK, gen)), i)
    ckpt = step.state_dict()
    batch = make_batch("mlp", PER_RANK, gen)
    seeded(lambda: step(*batch), 5)
    torch.manual_seed(123)
    fresh_model = make_model("dropout_bn")
    fresh = transpile(fresh_model, sgd(fresh_model.parameters()), loss_fn=LOSS)
    fresh.load_state_dict(ckpt)
    seeded(lambda: fresh(*batch), 5)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()))
    return {"same": same, "running_mean": fresh_model.body[1].running_mean.clone()}


def group_timeouts() -> dict:
    """Seconds of timeout of every group an AdaSum step uses (its world group and subgroups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from transpiler.runtime.process_group import group_timeout

    out = {}
    for label, execution in (("default", Execution()), ("explicit", Execution(timeout=7))):
        model = MLP()
        batch = make_batch("mlp", PER_RANK, None)
        step = transpile(
            model, sgd(model.parameters()), "adasum", loss_fn=LOSS, example_inputs=batch, execution=execution
        )
        names = [step.placement.group_name, *step.program.subgroups.values()]
        out[label] = [group_timeout(_resolve_process_group(n)).total_seconds() for n in names]
    return out


def stay_silent() -> float:
    """Rank 1's stall: silent until rank 0 has saved its outcome (it failed, as it should, after the 3 s timeout),
    or for 4 x the timeout if it has not (it waited for this rank: then it gets no error, and the test fails).
    Returns the seconds it was silent."""
    start = time.monotonic()
    survivor = os.path.join(sys.argv[1], "rank0.pt")
    while not os.path.exists(survivor) and time.monotonic() - start < 4 * SHORT:
        time.sleep(0.05)
    return time.monotonic() - start


def fault(kind: str, rank: int) -> dict:
    torch.manual_seed(0)
    model = MLP()
    step = transpile(model, sgd(model.parameters()), loss_fn=LOSS, execution=Execution(timeout=SHORT))
    gen = torch.Generator().manual_seed(rank)
    step(*make_batch("mlp", PER_RANK, gen))  # a healthy first step: handshake and startup done
    if rank == 1 and kind == "die":
        os._exit(0)
    if rank == 1 and kind == "stall":
        stay_silent()
    if rank == 1 and kind == "freeze_one":
        model.net[0].requires_grad_(False)
    if kind == "stall_in_save":
        if rank == 1:  # through the checkpointer's first barrier, then silent while rank 0 is in DCP's collectives
            torch.distributed.barrier(group=live_group(step.placement))
            return {"type": None, "message": "stalled", "seconds": stay_silent()}
        return expect_error(Checkpointer(step, os.path.join(sys.argv[1], "checkpoints"), every=1).save)
    return expect_error(lambda: step(*make_batch("mlp", PER_RANK, gen)))


def checks(rank: int, world: int, kind: str) -> dict:
    if kind != "world":
        return fault(kind, rank)
    results = {"mismatch": mismatches(rank), "timeouts": group_timeouts()}
    for name in MODEL_NAMES:
        results[name] = parity(name, rank, world, switch_modes=name == "dropout_bn")
    for name in HF:
        try:
            import transformers  # noqa: F401
        except ImportError:
            continue
        results[name] = parity(name, rank, world, steps=3)
    results["freeze"] = consistent_freeze(rank)
    results["restore"] = restore_per_rank(rank)
    return results


if __name__ == "__main__":
    run_rank(checks, destroy_group=sys.argv[2] == "world")  # a broken group (fault worlds) must not hang the exit
