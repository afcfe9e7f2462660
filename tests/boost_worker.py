"""One rank of the Boost/SINGA strategy runs (launched by tests/test_boost.py), all in one world.

Every check trains from the same initial MLP on per-rank shards of the same
global batches, next to a reference: PyTorch DDP (with ``no_sync`` for
accumulation, ``clip_grad_norm_`` for clipping), the transpiled step without
the strategy, or an eager computation written here from the published rule
(top-K with error feedback, sequential optimizer per gathered gradient,
SINGA's partial average). Each rank saves what it saw; the test compares.
"""

from __future__ import annotations

import copy
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, make_batch  # noqa: E402
from transpiler import (  # noqa: E402
    Accumulation,
    Clipping,
    Compression,
    Execution,
    Freeze,
    LossScaling,
    Sparsification,
    TraceCache,
    mode_config,
    transpile,
)

PER_RANK = 8
LOSS = nn.CrossEntropyLoss()


def params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sgd(model, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)


def global_batches(n: int, world: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return [make_batch("mlp", PER_RANK * world, gen) for _ in range(n)]


def shard(batch, rank):
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return batch[0][sl], batch[1][sl]


def base_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


TWO = Accumulation(steps=2)
FIXED_256 = LossScaling(dynamic=False, init_scale=256.0)
JOB_TRACES: list[TraceCache] = []  # the running job's traces: its runs of the MLP share them (set by ``checks``)


def transpiled(model, opt, mode, *args, execution=None, **options):
    """``transpile`` of mode ``mode`` with ``options`` (its config's fields), with the running job's trace cache."""
    return transpile(model, opt, mode_config(mode, **options), LOSS, *args, trace=JOB_TRACES[-1], execution=execution)


def run(mode, rank, world, batches, make_opt=sgd, **options):
    """Train a transpiled copy of the base model; parameters after every call, metrics and variants."""
    model = base_model()
    opt = make_opt(model)
    step = transpiled(model, opt, mode, **options)
    out = {"params": [], "metrics": [], "variants": [], "step": step, "model": model, "opt": opt}
    for batch in batches:
        step(*shard(batch, rank))
        out["params"].append(params_of(model))
        out["metrics"].append(dict(step.last_metrics))
        out["variants"].append(step.last_variant)
    return out


def references() -> tuple[DDP, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """DDP and one process, each from the initial model, each with its own SGD."""
    ddp, single = DDP(base_model()), base_model()
    return ddp, sgd(ddp.module), single, sgd(single)


def grad_scaler_reference(rank: int, batches: list) -> list[tuple[float, dict]]:
    """torch's own dynamic loss scaling, the independent reference: DDP with ``torch.amp.GradScaler`` on the same
    batches and the same inf (rank 1, call 3), the scale after each step and the parameters."""
    ddp, ddp_opt, _, _ = references()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    record = []
    for t, batch in enumerate(batches):
        x, y = shard(batch, rank)
        if t == 2 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        ddp_opt.zero_grad()
        scaler.scale(LOSS(ddp(x), y)).backward()
        scaler.step(ddp_opt)
        scaler.update()
        record.append((float(scaler.get_scale()), params_of(ddp.module)))
    return record


def comm_plan(step) -> dict:
    return {v: [str(op) for op in p.graph.nodes if "collective" in op.meta] for v, p in step.programs.items()}


def accumulation(rank, world) -> dict:
    batches = global_batches(6, world)
    ours = run("fused_allreduce", rank, world, batches, accumulation=Accumulation(steps=2))
    ddp, ddp_opt, single, single_opt = references()
    ddp_params, single_params = [], []
    for i, batch in enumerate(batches):
        x, y = shard(batch, rank)
        if i % 2 == 0:
            with ddp.no_sync():
                (LOSS(ddp(x), y) / 2).backward()
        else:
            (LOSS(ddp(x), y) / 2).backward()
            ddp_opt.step()
            ddp_opt.zero_grad()
            x2 = torch.cat([batches[i - 1][0], batch[0]])
            y2 = torch.cat([batches[i - 1][1], batch[1]])
            single_opt.zero_grad()
            LOSS(single(x2), y2).backward()
            single_opt.step()
        ddp_params.append(params_of(ddp.module))
        single_params.append(params_of(single))
    return {
        "ours": ours["params"],
        "variants": ours["variants"],
        "plans": comm_plan(ours["step"]),
        "ddp": ddp_params,
        "single": single_params,
    }


def gathered(tensors: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    """Every rank's copy of each tensor, stacked: [world, *shape]."""
    out = {}
    for n, t in tensors.items():
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        out[n] = torch.stack(parts)
    return out


def accumulated_grads(model: nn.Module, micro: list) -> dict[str, torch.Tensor]:
    """Eager: the gradient one cycle accumulates, each micro-step's loss divided by the number of micro-steps."""
    model.zero_grad()
    for x, y in micro:
        (LOSS(model(x), y) / len(micro)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def accumulation_composed(rank, world) -> dict:
    """Accumulation (2 micro-steps) with AdaSum and with LocalSGD (k=2), each next to a reference from the
    published rule. Per cycle, an eager twin at the step's own parameters and optimizer state records what the
    test needs: for AdaSum every rank's accumulated gradient (the test applies the AdaSum tree and SGD with
    momentum), for LocalSGD every rank's parameters after its local update (the test holds a sync to their mean
    and a local update to this rank's own)."""
    batches = global_batches(8, world)
    cycles = [[shard(b, rank) for b in batches[i : i + 2]] for i in range(0, len(batches), 2)]
    out = {}
    for mode, options in (("adasum", {}), ("local_sgd", {"k_steps": 2})):
        model = base_model()
        opt = sgd(model)
        step = transpiled(model, opt, mode, accumulation=Accumulation(steps=2), **options)
        twin = base_model()
        twin_opt = sgd(twin)
        record = []
        for micro in cycles:
            twin.load_state_dict(model.state_dict())
            twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters() if opt.state[p]}
            entry = {"before": params_of(model), "momentum": momentum}
            if mode == "adasum":
                entry["grads"] = gathered(accumulated_grads(twin, micro), world)
            else:
                accumulated_grads(twin, micro)
                twin_opt.step()
                entry["pre"] = gathered(params_of(twin), world)
            for x, y in micro:
                step(x, y)
            entry.update(after=params_of(model), variant=step.last_variant)
            record.append(entry)
        out[mode] = record
    return out


def loss_scaling(rank, world) -> dict:
    batches = global_batches(8, world)
    out = {}
    # an inf in rank 1's batch at call 3: every rank skips and backs off; growth after 3 clean steps
    model = base_model()
    opt = sgd(model)
    step = transpiled(model, opt, "fused_allreduce", loss_scaling=LossScaling(init_scale=1024.0, growth_interval=3))
    record, seen = [], []
    for t, batch in enumerate(batches):
        x, y = shard(batch, rank)
        if t == 2 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        before = params_of(model)
        momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()} if t else {}
        step(x, y)
        after = params_of(model)
        unchanged = all(torch.equal(before[n], after[n]) for n in after)
        kept = bool(momentum) and all(
            torch.equal(momentum[n], opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters()
        )
        record.append((dict(step.last_metrics), unchanged, kept, float(step.extra["loss_scale.scale"])))
        seen.append(after)
    out["inject"], out["inject_params"] = record, seen
    out["inject_state"] = sorted(step.state_dict()["transpiler"]["extra"])
    out["grad_scaler"] = grad_scaler_reference(rank, batches)
    clean = batches[:5]
    plain = run("fused_allreduce", rank, world, clean)["params"]
    out["clean"] = (run("fused_allreduce", rank, world, clean, loss_scaling=LossScaling())["params"], plain)
    fp16 = run("fused_allreduce", rank, world, clean, compression=Compression(wire_dtype="fp16"))["params"]
    out["compress"] = (
        run("fused_allreduce", rank, world, clean, compression=Compression(), loss_scaling=FIXED_256)["params"],
        fp16,
    )
    out["adasum"] = (
        run("adasum", rank, world, clean, loss_scaling=LossScaling())["params"],
        run("adasum", rank, world, clean)["params"],
    )
    acc = run("fused_allreduce", rank, world, batches[:6], accumulation=Accumulation(steps=2))["params"]
    out["accumulation"] = (
        run("fused_allreduce", rank, world, batches[:6], accumulation=TWO, loss_scaling=LossScaling())["params"],
        acc,
    )
    return out


def clipping(rank, world) -> dict:
    batches = global_batches(5, world)
    ours = run("fused_allreduce", rank, world, batches, clipping=Clipping(max_norm=0.3))
    ddp, ddp_opt, single, single_opt = references()
    ddp_params, ddp_norms, single_params = [], [], []
    for batch in batches:
        ddp_opt.zero_grad()
        LOSS(ddp(*shard(batch, rank)[:1]), shard(batch, rank)[1]).backward()
        ddp_norms.append(float(nn.utils.clip_grad_norm_(ddp.module.parameters(), 0.3)))
        ddp_opt.step()
        ddp_params.append(params_of(ddp.module))
        single_opt.zero_grad()
        LOSS(single(batch[0]), batch[1]).backward()
        nn.utils.clip_grad_norm_(single.parameters(), 0.3)
        single_opt.step()
        single_params.append(params_of(single))
    combined = run(
        "fused_allreduce",
        rank,
        world,
        global_batches(6, world),
        accumulation=TWO,
        loss_scaling=LossScaling(),
        clipping=Clipping(max_norm=0.3),
    )
    plain = run(
        "fused_allreduce", rank, world, global_batches(6, world), accumulation=TWO, clipping=Clipping(max_norm=0.3)
    )
    return {
        "ours": ours["params"],
        "norms": [m["grad_norm"] for m in ours["metrics"]],
        "ddp": ddp_params,
        "ddp_norms": ddp_norms,
        "single": single_params,
        "combined": (combined["params"], plain["params"]),
    }


def compression(rank, world) -> dict:
    batches = global_batches(5, world)
    out = {"plain": run("fused_allreduce", rank, world, batches)["params"]}
    twin = base_model()  # every rank's 1/W share of the first gradient, for the error bound of one step
    (LOSS(twin(shard(batches[0], rank)[0]), shard(batches[0], rank)[1]) * (1.0 / world)).backward()
    out["shares"] = {}
    for n, p in twin.named_parameters():
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(parts, p.grad)
        out["shares"][n] = torch.stack(parts)
    for wire in ("fp16", "bf16"):
        ours = run("fused_allreduce", rank, world, batches, compression=Compression(wire_dtype=wire))
        out[wire] = ours["params"]
        out[f"{wire}_plan"] = [n.meta["collective"] for n in ours["step"].program.graph.nodes if "collective" in n.meta]
    local = {"k_steps": 2}
    out["local"] = (
        run("local_sgd", rank, world, batches, compression=Compression(), **local)["params"],
        run("local_sgd", rank, world, batches, **local)["params"],
    )
    return out


def freeze(rank, world) -> dict:
    batches = global_batches(10, world)
    out = {}
    for name, options in (
        ("interval", {"freeze": Freeze(groups=3, type=1, p=0.4, seed=7)}),
        ("continuous", {"freeze": Freeze(groups=3, type=0, p=0.5)}),
        ("accumulate", {"freeze": Freeze(groups=3, type=1, p=0.4, seed=7), "accumulation": TWO}),
    ):
        model = base_model()
        opt = sgd(model)
        step = transpiled(model, opt, "fused_allreduce", **options)
        record = []
        for batch in batches:
            before = params_of(model)
            momentum = {n: opt.state[p].get("momentum_buffer") for n, p in model.named_parameters()}
            momentum = {n: None if m is None else m.clone() for n, m in momentum.items()}
            step(*shard(batch, rank))
            after = params_of(model)
            changed = [not torch.equal(before[n], after[n]) for n in after]
            kept = [
                momentum[n] is None or torch.equal(momentum[n], opt.state[p]["momentum_buffer"])
                for n, p in model.named_parameters()
            ]
            record.append((step.last_variant, changed, kept, after))
        out[name] = record
    return out


def sparsification(rank, world) -> dict:
    batches = global_batches(4, world)
    ratio = 0.3
    model = base_model()
    opt = sgd(model, momentum=0.0)
    step = transpiled(
        model, opt, "fused_allreduce", shard(batches[0], rank), sparsification=Sparsification(ratio=ratio)
    )
    twin = base_model()
    order = [n.meta["collective"] for n in step.program.graph.nodes if n.meta.get("collective", {}).get("k")]
    names = list(order[0]["grads"])
    residual = {n: torch.zeros_like(p) for n, p in twin.named_parameters()}
    record = []
    for batch in batches:
        x, y = shard(batch, rank)
        # the published rule, eagerly: x = g/W + residual; send the top-K of |x|; keep x - sent
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        (LOSS(twin(x), y) * (1.0 / world)).backward()
        grads = dict(twin.named_parameters())
        flat = torch.cat([(grads[n].grad + residual[n]).reshape(-1) for n in names])
        k = math.ceil(ratio * flat.numel())
        idx = torch.topk(flat.abs(), k).indices
        sent = torch.zeros_like(flat).index_copy(0, idx, flat[idx])
        left = flat - sent
        exact = torch.equal(sent + left, flat)
        dense = [torch.zeros_like(sent) for _ in range(world)]
        dist.all_gather(dense, sent)
        total = dense[0]
        for other in dense[1:]:
            total = total + other
        expected, offset = {}, 0
        for n in names:
            size = grads[n].numel()
            residual[n] = left[offset : offset + size].view_as(grads[n])
            expected[n] = torch.add(
                twin.get_parameter(n).detach(), total[offset : offset + size].view_as(grads[n]), alpha=-0.05
            )
            offset += size
        step(x, y)
        ours_residual = {n: step.extra[f"residual.{n}"] for n in names}
        record.append(
            {
                "exact": exact,
                "k": k,
                "residual_equal": all(torch.equal(ours_residual[n], residual[n]) for n in names),
                "params": params_of(model),
                "reference": expected,
            }
        )
    topk = [n.args[1] for n in step.program.graph.nodes if n.target is torch.ops.transpiler.top_magnitudes.default]
    sizes = [sum(model.get_parameter(n).numel() for n in c["grads"]) for c in order]
    one = run("fused_allreduce", rank, world, batches, sparsification=Sparsification(ratio=1.0))["params"]
    dense_run = run("fused_allreduce", rank, world, batches)["params"]
    return {
        "record": record,
        "topk": topk,
        "sizes": sizes,
        "in_state_dict": sorted(step.state_dict()["transpiler"]["extra"]),
        "bytes": sum(c["bytes"] for c in order),
        "ratio_one": (one, dense_run),
    }


def allgather(rank, world) -> dict:
    batches = global_batches(4, world)
    out = {}
    for name, make in (("sgd", sgd), ("adam", lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))):
        ours = run("allgather", rank, world, batches, make_opt=make)["params"]
        ref = base_model()
        ref_opt = make(ref)
        reference = []
        for batch in batches:  # Paddle's rule: the optimizer once per rank's gradient, in rank order
            grads = []
            for r in range(world):
                ref.zero_grad()
                (LOSS(ref(shard(batch, r)[0]), shard(batch, r)[1]) * (1.0 / world)).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for g in grads:
                for p, gi in zip(ref.parameters(), g):
                    p.grad = gi
                ref_opt.step()
            reference.append(params_of(ref))
        out[name] = (ours, reference)
    return out


def partial_sync(rank, world) -> dict:
    batches = global_batches(6, world)
    partitions = 3
    model = base_model()
    opt = sgd(model)
    example = shard(batches[0], rank)
    step = transpiled(model, opt, "partial_sync", example, partitions=partitions, bucket_cap_mb=0.001)
    ref = base_model()
    ref_opt = sgd(ref)
    members = {
        v: sorted({n for node in p.graph.nodes if "collective" in node.meta for n in node.meta["collective"]["params"]})
        for v, p in step.programs.items()
    }
    record = []
    for batch in batches:
        x, y = shard(batch, rank)
        ref_opt.zero_grad()
        LOSS(ref(x), y).backward()
        ref_opt.step()
        step(x, y)
        with torch.no_grad():  # SINGA: all-reduce the partition's parameters, divide by the world size
            for n in members[step.last_variant]:
                p = ref.get_parameter(n)
                dist.all_reduce(p)
                p.div_(world)
        record.append((step.last_variant, params_of(model), params_of(ref)))
    return {"record": record, "members": members, "names": [n for n, _ in model.named_parameters()]}


WRAPPERS = {
    "accumulation": Accumulation(steps=2),
    "loss_scaling": LossScaling(),
    "clipping": Clipping(max_norm=0.3),
    "freeze": Freeze(groups=2, type=0, p=0.5),
}


def wrapped_reference(rank: int, world: int, batches: list) -> list[dict]:
    """WRAPPERS written eagerly from their published rules, the independent reference: each micro-step's loss /2
    scaled by ``torch.amp.GradScaler`` (2**16, torch's default, as ours) and backpropagated; Boost's continuous
    freeze cycle for 2 groups and p=0.5 (one zero: 0 1 0 1 ..., the index held for a cycle) drops group 0's
    gradients (the first 3 of the MLP's 6 tensors) on odd updates; the rest are summed over the ranks with
    all_reduce and divided by W (DDP's arithmetic), unscaled, clipped with ``clip_grad_norm_`` and stepped."""
    model = base_model()
    opt = sgd(model)
    scaler = torch.amp.GradScaler("cpu")
    params = list(model.parameters())
    out = []
    for update, i in enumerate(range(0, len(batches), 2)):
        frozen = set(range(3)) if update % 2 else set()
        opt.zero_grad()
        for batch in batches[i : i + 2]:
            x, y = shard(batch, rank)
            scaler.scale(LOSS(model(x), y) / 2).backward()
        for j, p in enumerate(params):
            if j in frozen:
                p.grad = None
            else:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], WRAPPERS["clipping"].max_norm)
        scaler.step(opt)
        scaler.update()
        out.append(params_of(model))
    return out


def allreduce_wrappers(rank, world) -> dict:
    """``allreduce`` and ``fused_allreduce`` with accumulation, dynamic loss scaling, clipping and freeze all
    switched on, against the eager reference (bitwise at world size 2: the scale and 1/2 are powers of two, a
    sum of two values does not depend on the order, and clipping runs clip_grad_norm_'s ops)."""
    batches = global_batches(8, world)
    ours = run("allreduce", rank, world, batches, **WRAPPERS)
    fused = run("fused_allreduce", rank, world, batches, **WRAPPERS)
    return {
        "ours": ours["params"][1::2],
        "fused": fused["params"][1::2],
        "variants": ours["variants"],
        "reference": wrapped_reference(rank, world, batches),
    }


def compiled(rank, world) -> dict:
    """compile=True against the same mode uncompiled, 4 steps each (issue 9: torch.compile)."""
    batches = global_batches(4, world)
    out = {}
    for mode, options in (("fused_allreduce", {}), ("local_sgd", {"k_steps": 2}), ("adasum", {})):
        plain = run(mode, rank, world, batches, **options)
        fast = run(mode, rank, world, batches, execution=Execution(compile=True), **options)
        out[mode] = {
            "plain": plain["params"],
            "compiled": fast["params"],
            "seconds": fast["step"].compile_seconds,
            "variants": fast["variants"],
        }
    return out


def checks(rank: int, world: int) -> dict:
    result = {}
    JOB_TRACES[:] = [TraceCache()]
    try:
        for check in (
            accumulation,
            accumulation_composed,
            loss_scaling,
            clipping,
            compression,
            freeze,
            sparsification,
            allgather,
            partial_sync,
            allreduce_wrappers,
            compiled,
        ):
            result[check.__name__] = check(rank, world)
    finally:
        JOB_TRACES.clear()  # no trace outlives its job
    for value in result.values():  # step objects do not pickle
        if isinstance(value, dict):
            value.pop("step", None)
    return result


if __name__ == "__main__":
    run_rank(checks)
