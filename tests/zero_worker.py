"""One rank of the sharded-optimizer runs (launched by tests/test_zero.py): zero1 and zero2 against DDP.

Each scenario trains the same model three ways from the same weights and batches: the transpiled step on
this rank's shard, DDP on the same shard (``gradient_as_bucket_view=True``, so its gradients are views of its
buckets and count once) and, on rank 0, a single process on the whole batch. After every step it records how
far our parameters are from DDP's and the single process's, and how far this rank's optimizer-state slices are
from the same slices of DDP's state. It also saves the memory reports, a resumed run, and the errors for
what the modes refuse.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from unittest import mock

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import HFLoss, Lamb, Lion, make_batch, make_model  # noqa: E402
from tests.helpers import capture_by_calling  # noqa: E402
from transpiler import Accumulation, Clipping, Execution, LossScaling, TraceCache, mode_config, transpile  # noqa: E402

STEPS = 5
PER_RANK = 4
CAPS = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001}  # several buckets even on the small models
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),  # the generic path, state made lazily
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # the generic path, state made up front
    "lamb": lambda ps: Lamb(ps, lr=1e-2),  # per-tensor norms: one all-reduce of the slices' norms
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3, weight_decay=0.01),  # the generic path, mu products
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),  # a user's optimizer: sign of a momentum mix
}


def build_model(name: str) -> torch.nn.Module:
    if name != "gpt2":
        return make_model(name)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )  # no dropout: the three runs draw their masks in different orders
    return HFLoss(GPT2LMHeadModel(config))


def batches(name: str, world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(99)
    if name == "gpt2":
        return [(torch.randint(0, 100, (PER_RANK * world, 8), generator=gen),) for _ in range(steps)]
    return [make_batch(name, PER_RANK * world, gen) for _ in range(steps)]


def loss_of(name: str, model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    if name == "gpt2":
        return model(batch[0])
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def state_slices(model, optimizer, shards: dict[str, tuple[int, int]] | None) -> dict[str, torch.Tensor]:
    """Optimizer state by ``param.key``; with ``shards``, what this rank holds of DDP's whole tensors."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if shards is not None and name in shards and value.shape == p.shape:
                lo, hi = shards[name]
                value = value.reshape(-1)[lo:hi]
            out[f"{name}.{key}"] = value.detach().clone()
    return out


def largest(a: dict, b: dict) -> tuple[bool, float]:
    """Whether ``a`` and ``b`` hold the same bits, and their largest difference."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    diffs = [(x.double() - y.double()).abs().max().item() if x.numel() else 0.0 for x, y in zip(a.values(), b.values())]
    return all(torch.equal(a[k], b[k]) for k in a), max(diffs, default=0.0)


def scenario(
    model_name: str,
    opt_name: str,
    mode: str,
    rank: int,
    world: int,
    traces: TraceCache,
    accumulate: int = 1,
    **mode_options,
) -> dict:
    torch.manual_seed(1234)
    base = build_model(model_name)
    ours, ddp_model, single = (copy.deepcopy(base) for _ in range(3))
    make = OPTIMIZERS[opt_name]
    ours_opt, single_opt = make(ours.parameters()), make(single.parameters())
    ddp = DDP(ddp_model, gradient_as_bucket_view=True)
    ddp_opt = make(ddp.parameters())
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    data = batches(model_name, world)
    options = dict(CAPS, accumulation=Accumulation(steps=accumulate)) if accumulate > 1 else dict(CAPS)
    options.update(mode_options)
    execution = Execution(cuda_graph=options.pop("cuda_graph", False))  # the scenario's one execution setting
    loss_fn = None if model_name == "gpt2" else torch.nn.CrossEntropyLoss()
    config = mode_config(mode, **options)
    step = transpile(ours, ours_opt, config, loss_fn=loss_fn, trace=traces, execution=execution)
    record: dict = {"params": [], "state": [], "single": [], "ddp_single": []}
    for batch in data:
        micro = [tuple(t[shard][i::accumulate] for t in batch) for i in range(accumulate)]
        for part in micro:
            step(*part)
        ddp_opt.zero_grad()
        for i, part in enumerate(micro):
            if i < accumulate - 1:
                with ddp.no_sync():
                    (loss_of(model_name, ddp, part) / accumulate).backward()
            else:
                (loss_of(model_name, ddp, part) / accumulate).backward()
        ddp_opt.step()
        theirs = dict(ddp.module.named_parameters())
        shards = step.program.shards
        record["state"].append(largest(state_slices(ours, ours_opt, None), state_slices(ddp.module, ddp_opt, shards)))
        if rank == 0:
            single_opt.zero_grad()
            loss_of(model_name, single, batch).backward()
            single_opt.step()
        with step.gathered():  # zero3: the whole parameters (a no-op in the other modes)
            record["params"].append(
                largest(
                    {n: p.detach() for n, p in ours.named_parameters()},
                    {n: theirs[n].detach() for n, _ in ours.named_parameters()},
                )
            )
            if rank == 0:
                record["single"].append(largest(dict(ours.named_parameters()), dict(single.named_parameters()))[1])
                record["ddp_single"].append(largest(theirs, dict(single.named_parameters()))[1])
            record["final"] = {n: p.detach().clone() for n, p in ours.named_parameters()}
    report = step.memory_report()
    record["memory"] = {k: getattr(report, k) for k in ("parameters", "gradients", "optimizer_state", "peak")}
    record["ddp_state_bytes"] = sum(t.numel() * t.element_size() for s in ddp_opt.state.values() for t in s.values())
    record["model_bytes"] = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    record["model_tensors"] = len(list(ddp.module.parameters()))
    record["param_buckets"] = len(step.program.param_buckets)
    record["shards"] = dict(step.program.shards)
    record["kinds"] = [n.meta["collective"]["kind"] for n in step.graph_module.graph.nodes if "collective" in n.meta]
    record["captures"] = step.captures
    record["decisions"] = dict(step.program.decisions)
    return record


SCALER = {"init_scale": 2.0**20, "growth_interval": 3}  # fp16 overflows at 2**20: early steps are skipped


def composed(
    model_name: str,
    opt_name: str,
    mode: str,
    scale: bool,
    clip: tuple[float, float] | None,
    rank: int,
    world: int,
    traces: TraceCache,
) -> dict:
    """Loss scaling (under fp16 autocast) and clipping on shards, 10 steps, against DDP with GradScaler and
    ``clip_grad_norm_`` on the same shard: parameters, grad norms and skipped steps after every step."""
    torch.manual_seed(1234)
    base = build_model(model_name)
    ours, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    make = OPTIMIZERS[opt_name]
    ours_opt = make(ours.parameters())
    ddp = DDP(ddp_model, gradient_as_bucket_view=True)
    ddp_opt = make(ddp.parameters())
    options = dict(CAPS)
    if scale:
        options |= {"loss_scaling": LossScaling(**SCALER)}
    if clip is not None:
        options |= {"clipping": Clipping(max_norm=clip[0], norm_type=clip[1])}
    step = transpile(ours, ours_opt, mode_config(mode, **options), loss_fn=torch.nn.CrossEntropyLoss(), trace=traces)
    # our seed is S/W on each rank (as one process on the whole batch has it); DDP's backward carries the
    # scaler's S whole, so DDP with S/W runs the same fp16 backward and overflows on the same steps
    scaler = torch.amp.GradScaler("cpu", enabled=scale, **(SCALER | {"init_scale": SCALER["init_scale"] / world}))
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    record: dict = {"params": [], "norms": [], "skipped": []}
    for batch in batches(model_name, world, steps=10):
        part = tuple(t[shard] for t in batch)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scale):
            step(*part)
            loss = loss_of(model_name, ddp, part)
        ddp_opt.zero_grad()
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(ddp_opt)
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip[0], norm_type=clip[1])
            record["norms"].append((float(step.last_metrics["grad_norm"]), float(norm)))
        scaler.step(ddp_opt)
        used = scaler.get_scale()
        scaler.update()
        if scale:  # GradScaler backs off exactly when it skipped a step
            record["skipped"].append((bool(step.last_metrics["overflow"]), scaler.get_scale() < used))
        theirs = dict(ddp.module.named_parameters())
        with step.gathered():
            record["params"].append(
                largest(dict(ours.named_parameters()), {n: theirs[n] for n, _ in ours.named_parameters()})
            )
    return record


def compiled(mode: str, rank: int, world: int, traces: TraceCache) -> dict:
    """``compile=True``: AdamW with a LambdaLR scheduler, 8 steps against DDP with the same scheduler, on the
    MLP (whose buckets are padded to W shards); and how many graphs Dynamo made."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(1234)
    base = build_model("mlp")
    ours, ddp = copy.deepcopy(base), DDP(copy.deepcopy(base), gradient_as_bucket_view=True)
    ours_opt, ddp_opt = OPTIMIZERS["adamw"](ours.parameters()), OPTIMIZERS["adamw"](ddp.parameters())
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0 / (1 + i)) for o in (ours_opt, ddp_opt)]
    loss_fn = torch.nn.CrossEntropyLoss()
    step = transpile(
        ours, ours_opt, mode_config(mode, **CAPS), loss_fn=loss_fn, trace=traces, execution=Execution(compile=True)
    )
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    record: dict = {"params": []}
    for batch in batches("mlp", world, steps=8):
        part = tuple(t[shard] for t in batch)
        step(*part)
        ddp_opt.zero_grad()
        loss_of("mlp", ddp, part).backward()
        ddp_opt.step()
        for scheduler in schedulers:
            scheduler.step()
        theirs = dict(ddp.module.named_parameters())
        with step.gathered():
            record["params"].append(largest(dict(ours.named_parameters()), theirs)[1])
    record["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    record["compile_seconds"] = dict(step.compile_seconds)
    return record


def resume(rank: int, world: int, mode: str, traces: TraceCache) -> dict:
    """Three steps, a checkpoint, two more; and a fresh model, optimizer and step loading it for the same two."""
    data = batches("tied", world)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def fresh():  # built ahead (example_inputs): zero3 must know its slices to load them
        torch.manual_seed(1234)
        model = build_model("tied")
        optimizer = OPTIMIZERS["adamw"](model.parameters())
        loss_fn = torch.nn.CrossEntropyLoss()
        example = (data[0][0][shard], data[0][1][shard])
        return model, optimizer, transpile(model, optimizer, mode_config(mode, **CAPS), loss_fn, example, trace=traces)

    model, optimizer, step = fresh()
    for x, y in data[:3]:
        step(x[shard], y[shard])
    saved = step.state_dict()
    for x, y in data[3:]:
        step(x[shard], y[shard])
    model2, optimizer2, step2 = fresh()
    step2.load_state_dict(saved)
    for x, y in data[3:]:
        step2(x[shard], y[shard])
    return {
        "params": largest(dict(model.named_parameters()), dict(model2.named_parameters())),
        "state": largest(state_slices(model, optimizer, None), state_slices(model2, optimizer2, None)),
    }


def refusals(rank: int, world: int) -> dict:
    """What the sharded modes refuse, and the words they use."""
    out = {}
    for name, make in {
        "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
        "norm": lambda ps: RowNormalisedSGD(ps, lr=0.1),
    }.items():
        model = make_model("mlp")
        try:
            transpile(
                model,
                make(model.parameters()),
                "zero1",
                loss_fn=torch.nn.CrossEntropyLoss(),
                example_inputs=make_batch("mlp", PER_RANK, torch.Generator().manual_seed(0)),
            )
            out[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the test checks the type and words
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


class RowNormalisedSGD(torch.optim.Optimizer):
    """A user's optimizer that needs whole rows: each row's step is scaled by that row's norm (a norm along a
    dimension, which a slice cannot give; a whole tensor's norm it can, as LAMB's)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm(dim=-1, keepdim=True) + 1e-8), alpha=-group["lr"])


SCENARIOS = {
    2: [
        ("tied", "sgd", "zero1", 1),
        ("tied", "adamw", "zero2", 1),
        ("mlp", "rmsprop", "zero1", 1),
        ("mlp", "adamw", "zero2", 2),
        ("gpt2", "adamw", "zero1", 1),
        ("gpt2", "sgd", "zero2", 1),
        ("tied", "adamw", "zero1", 2),
        ("tied", "adamw", "zero3", 1),
        ("tied", "sgd", "zero3", 2),
        ("tied", "lamb", "zero2", 1),
        ("mlp", "rmsprop", "zero3", 1),
        ("gpt2", "sgd", "zero3", 1),
        ("gpt2", "adamw", "zero3", 1, {"reshard_after_forward": False}),
        ("tied", "nadam", "zero2", 1),
        ("mlp", "lion", "zero3", 1),
        # cuda_graph=True with the capture replayed by calling (tests/helpers.ReplayByCalling): warm-ups, one
        # capture, replays reading the sharded inputs where they were captured, across gathered() every step
        ("tied", "adamw", "zero3", 1, {"cuda_graph": True}),
        # (the MLP, not GPT-2: gloo's heap bug, docs/strategies/zero.md, shows around GPT-2's many small buckets)
        ("mlp", "adamw", "zero1", 1, {"cuda_graph": True}),
        ("mlp", "sgd", "zero2", 1, {"cuda_graph": True}),
        # zero3's default gather units, sized on the all-gather cost the ranks measure at startup
        ("gpt2", "adamw", "zero3", 1, {"bucket_cap_mb": "cost"}),
    ],
    4: [
        ("tied", "adamw", "zero1", 1),
        ("tied", "sgd", "zero2", 1),
        ("mlp", "adagrad", "zero2", 1),
        ("gpt2", "adamw", "zero2", 1),
        ("tied", "sgd", "zero3", 1),
        ("gpt2", "adamw", "zero3", 1),
        ("mlp", "adamw", "zero3", 4),  # micro-batches of one sample: equal sizes, as a mean of means needs
        ("tied", "lamb", "zero3", 1),  # the tied model, not GPT-2: the same paths, a tenth of the time
        ("gpt2", "nadam", "zero1", 1),
        ("mlp", "lion", "zero2", 1),
        ("tied", "adamw", "zero3", 1, {"bucket_cap_mb": "cost"}),
    ],
}


INF = float("inf")
# (model, optimizer, mode, loss scaling, clipping (max norm, p) or None)
COMPOSED = {
    2: [
        ("mlp", "adamw", "zero2", True, None),
        ("tied", "sgd", "zero1", False, (0.3, 2.0)),
        ("tied", "adamw", "zero2", False, (0.05, INF)),
        ("mlp", "rmsprop", "zero1", True, (0.3, 2.0)),
        ("tied", "adamw", "zero3", True, (0.05, INF)),
    ],
    4: [
        ("mlp", "adamw", "zero2", True, (0.3, 2.0)),
        ("tied", "sgd", "zero1", False, (0.05, INF)),
        ("mlp", "adamw", "zero3", True, (0.3, 2.0)),
    ],
}


def against_fsdp2(rank: int, world: int) -> dict:
    """``zero3`` with its defaults against FSDP2 wrapped as torchtitan wraps a model (every block, then the root;
    foreach AdamW) on GPT-2, 5 steps from the same weights and batches. Beside them, two of torch's own: FSDP2
    wrapped at the root alone (another bucketing of the same reduce-scatters) and DDP (all-reduce). Each step,
    ``largest`` of each one's whole parameters against the per-block FSDP2's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)
    base = build_model("gpt2")
    ours, per_block, root_only, replicated = (copy.deepcopy(base) for _ in range(4))
    mesh = init_device_mesh("cpu", (world,))
    for block in per_block.model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(per_block, mesh=mesh)
    fully_shard(root_only, mesh=mesh)
    models = (ours, per_block, root_only, DDP(replicated))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, foreach=True) for m in models]
    step = transpile(ours, optimizers[0], "zero3")
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    record: dict = {"zero3": [], "root_only": [], "ddp": []}
    for (ids,) in batches("gpt2", world):
        step(ids[shard])
        for model, optimizer in zip(models[1:], optimizers[1:]):
            optimizer.zero_grad()
            model(ids[shard]).backward()
            optimizer.step()
        wholes = [{n: p.full_tensor() for n, p in m.named_parameters()} for m in models[1:3]]
        with step.gathered():
            record["zero3"].append(largest({n: p.detach().clone() for n, p in ours.named_parameters()}, wholes[0]))
        record["root_only"].append(largest(wholes[1], wholes[0]))
        record["ddp"].append(largest({n: p.detach() for n, p in replicated.named_parameters()}, wholes[0]))
    record["decision"] = step.program.decisions.get("shard-optimizer", "")
    return record


def checks(rank: int, world: int) -> dict:
    traces = TraceCache()  # the scenarios of one model, optimizer and batch share their traces across modes
    results = {
        ",".join(map(str, s)): scenario(*s[:3], rank, world, traces, accumulate=s[3], **(s[4] if len(s) > 4 else {}))
        for s in SCENARIOS[world]
    }
    results["composed"] = {",".join(map(str, c)): composed(*c, rank, world, traces) for c in COMPOSED[world]}
    results["resume"] = {mode: resume(rank, world, mode, traces) for mode in ("zero1", "zero2", "zero3")}
    results["fsdp2"] = against_fsdp2(rank, world)
    if world == 2:
        results["refusals"] = refusals(rank, world)
        if os.environ.get("ATEN_CPU_CAPABILITY") != "default":  # Inductor's C++ does not build under it
            results["compiled"] = {mode: compiled(mode, rank, world, traces) for mode in ("zero1", "zero2", "zero3")}
    return results


def named(rank: int, world: int, names: str) -> dict:
    """The scenarios of :data:`SCENARIOS` that ``names`` lists (``;`` between them) as the results of :func:`checks`
    name them, alone (the quick tier: tests/test_quick_worlds.py)."""
    traces = TraceCache()
    names = names.split(";")
    chosen = [s for s in SCENARIOS[world] if ",".join(map(str, s)) in names]
    assert len(chosen) == len(names), f"no such scenarios: {set(names) - {','.join(map(str, s)) for s in chosen}}"
    return {
        ",".join(map(str, s)): scenario(*s[:3], rank, world, traces, accumulate=s[3], **(s[4] if len(s) > 4 else {}))
        for s in chosen
    }


def capturing_checks(rank: int, world: int) -> dict:
    """:func:`checks` with ``cuda_graph=True`` capturing on the CPU (only the scenarios that ask for it capture),
    and the capture put back afterwards: the rank's next job (tests/worlds.py) sees the module as it was."""
    with contextlib.ExitStack() as undo:
        capture_by_calling(lambda owner, name, value: undo.enter_context(mock.patch.object(owner, name, value)))
        return checks(rank, world)


if __name__ == "__main__":
    run_rank(capturing_checks)
