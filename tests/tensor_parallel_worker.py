"""One rank of the tensor-parallel runs (launched by tests/test_tensor_parallel.py): a Llama-style model under
torchtitan's plan on a ("dp", "tp") mesh, with and without sequence parallel, each mode across ``dp`` against the
eager runs a user would otherwise make, from the same weights and batches, for ``STEPS`` AdamW steps:

* eager TP with each shard's gradient averaged over ``dp`` here (what DDP would do, had it taken DTensors);
* eager TP with FSDP2 on ``mesh["dp"]`` (torchtitan's 2-D layout);
* one process on the whole batch, the model never split;
* for ``diloco`` (and ``streaming_diloco`` at dp=2 under sequence parallel), eager TP inside each replica and
  the paper's outer step on each shard (each fragment's), written here.

Each run records the loss of every step and this rank's shards of the parameters at the end.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.launch import run_rank  # noqa: E402
from bench.models import TinyLlama, llama_tp_plan  # noqa: E402
from passes.diloco_outer_step import fragments_of  # noqa: E402
from transpiler import Execution, mode_config, transpile  # noqa: E402
from transpiler.graph.collectives import is_collective  # noqa: E402

STEPS = 10
H = 3  # DiLoCo's inner steps per round
# τ=0: three programs to build, not five (the landing variants τ>0 adds are checked at the MLP, tests/test_diloco.py)
STREAM = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 0, "fragment_update_alpha": 0.5}
PER_RANK, SEQ, VOCAB = 4, 16, 64
MODES = ("fused_allreduce", "zero1", "zero2", "zero3")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def batches(dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each data-parallel rank's batch (tokens, next tokens)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (dp, PER_RANK, SEQ + 1), generator=gen)
        out.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens])
    return out


def base_model() -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(vocab=VOCAB, dim=32, heads=4, hidden=64, blocks=2)


def planned(base: TinyLlama, mesh, sequence_parallel: bool) -> TinyLlama:
    model = copy.deepcopy(base)
    parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel))
    return model


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def traced(base, mesh, sp: bool, data, mode: str, execution: Execution | None = None, **options) -> dict:
    model = planned(base, mesh, sp)
    dpr = mesh["dp"].get_local_rank()
    config = mode_config(mode, **options)
    step = transpile(
        model, adamw(model.parameters()), config, loss_fn, data[0][dpr], mesh=mesh["dp"], execution=execution
    )
    outputs = []
    if mode == "zero3":  # the model runs eagerly on its whole shards inside step.gathered(), before a step too
        with step.gathered() as whole, torch.no_grad():
            outputs.append(local(whole(data[0][dpr][0])))
    losses = [float(step(*batch[dpr])) for batch in data]
    with step.gathered() as whole:
        params = {n: local(p) for n, p in model.named_parameters()}
        if mode == "zero3":
            with torch.no_grad():
                outputs.append(local(whole(data[0][dpr][0])))
    record = {"losses": losses, "params": params, "outputs": outputs}
    if step.outer_optimizer is not None:
        record["global"] = {n: t.clone() for n, t in step.global_parameters().items()}
    if execution is not None:  # the recomputed ops (a tensor-parallel plan's collectives are never among them)
        copies = [n for n in step.program.graph.nodes if "recomputed_from" in n.meta]
        record["recomputed"] = (len(copies), sum(map(is_collective, copies)))
    if mode == "streaming_diloco":  # the parameters of each fragment, in order
        of = fragments_of(step.programs["sync0"], options["fragments"])
        record["fragments"] = [[n for n in params if of[n] == p] for p in range(options["fragments"])]
    return record


def average_over_dp(model: torch.nn.Module, mesh) -> None:
    """Each shard's gradient (a Partial one reduced over ``tp`` first, as the step does) divided by the size of
    ``dp`` and summed over it: what DDP would do, had it taken DTensor parameters."""
    dp, group = mesh["dp"].size(), mesh["dp"].get_group()
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):  # a Partial gradient (a norm's weight under SP) summed over tp first
            g = p.grad = g.redistribute(g.device_mesh, p.placements)
            g = g.to_local()
        g.div_(dp)
        dist.all_reduce(g, group=group)


def eager_averaged(base, mesh, sp: bool, data) -> dict:
    """Eager TP, each shard's gradient averaged over ``dp`` (:func:`average_over_dp`), then AdamW."""
    model = planned(base, mesh, sp)
    optimizer = adamw(model.parameters())
    dpr = mesh["dp"].get_local_rank()
    losses, outputs = [], []
    with torch.no_grad():
        outputs.append(local(model(data[0][dpr][0])))
    for batch in data:
        optimizer.zero_grad()
        loss = loss_fn(model(batch[dpr][0]), batch[dpr][1])
        loss.backward()
        average_over_dp(model, mesh)
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        outputs.append(local(model(data[0][dpr][0])))
    return {"losses": losses, "params": {n: local(p) for n, p in model.named_parameters()}, "outputs": outputs}


def eager_fsdp2(base, mesh, sp: bool, data) -> dict:
    """Eager TP with FSDP2 on ``mesh["dp"]``, per block and at the root, as torchtitan applies it."""
    from torch.distributed.fsdp import fully_shard

    model = planned(base, mesh, sp)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = adamw(model.parameters())
    dpr = mesh["dp"].get_local_rank()
    losses = []
    for batch in data:
        optimizer.zero_grad()
        loss = loss_fn(model(batch[dpr][0]), batch[dpr][1])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = {}
    for n, p in model.named_parameters():  # each shard over tp, gathered over dp
        placements = [Replicate()] + list(p.placements[1:])
        params[n] = p.redistribute(p.device_mesh, placements).to_local().detach().clone()
    return {"losses": losses, "params": params}


def single_process(base, data) -> dict:
    """The unsplit model on every data-parallel rank's batch at once."""
    model = copy.deepcopy(base)
    optimizer = adamw(model.parameters())
    losses = []
    for batch in data:
        optimizer.zero_grad()
        x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def eager_diloco(base, mesh, sp: bool, data, fragments: list[list[str]] | None = None) -> dict:
    """DiLoCo (Douillard et al. 2023, Algorithm 1) with eager TP inside each replica: H inner AdamW steps, then
    each shard's Δ = θ_global − θ averaged over ``dp`` through the paper's outer Nesterov SGD. With ``fragments``
    (parameter names, per fragment), Streaming DiLoCo (Douillard et al. 2025) as :data:`STREAM` sets it: fragment
    p's Δ is taken at the steps t ≡ (p+1)·H/P (mod H), averaged over ``dp`` ``delay`` inner steps later, when only
    that fragment's θ_global goes through the outer SGD, and the fragment becomes α·θ_local + (1−α)·θ_global."""
    sync_every, delay, alpha = H, 0, 0.0
    if fragments:
        sync_every, delay, alpha = STREAM["sync_every"], STREAM["fragment_sync_delay"], STREAM["fragment_update_alpha"]
    model = planned(base, mesh, sp)
    params = dict(model.named_parameters())
    fragments = fragments or [list(params)]
    inner = adamw(params.values())
    theta = {n: torch.nn.Parameter(local(p)) for n, p in params.items()}
    outer = torch.optim.SGD(theta.values(), lr=0.7, momentum=0.9, nesterov=True)
    dp, dpr, group = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    offsets = [(p + 1) * sync_every // len(fragments) for p in range(len(fragments))]
    pending: dict[int, dict[str, torch.Tensor]] = {}

    def shard(name: str) -> torch.Tensor:
        p = params[name]
        return p.to_local() if isinstance(p, DTensor) else p

    def apply(p: int) -> None:
        for g in theta.values():
            g.grad = None
        for name, delta in pending.pop(p).items():
            dist.all_reduce(delta, group=group)
            theta[name].grad = delta * (1.0 / dp)
        outer.step()
        with torch.no_grad():
            for name in fragments[p]:
                shard(name).copy_(alpha * shard(name) + (1 - alpha) * theta[name])

    losses = []
    for t, batch in enumerate(data, 1):
        inner.zero_grad()
        loss = loss_fn(model(batch[dpr][0]), batch[dpr][1])
        loss.backward()
        inner.step()
        losses.append(loss.item())
        for p, offset in enumerate(offsets):
            if t >= offset and (t - offset) % sync_every == 0:
                pending[p] = {n: theta[n].detach() - shard(n).detach() for n in fragments[p]}
            if t - delay >= offset and (t - delay - offset) % sync_every == 0:
                apply(p)
    return {
        "losses": losses,
        "params": {n: local(p) for n, p in params.items()},
        "global": {n: g.detach().clone() for n, g in theta.items()},
    }


def shards_of(whole: dict[str, torch.Tensor], base: TinyLlama, mesh, sp: bool) -> dict[str, torch.Tensor]:
    """This rank's shards of the single process's parameters, cut as the plan cuts them."""
    model = planned(base, mesh, sp)
    return {
        n: distribute_tensor(whole[n], mesh["tp"], p.placements).to_local() if isinstance(p, DTensor) else whole[n]
        for n, p in model.named_parameters()
    }


def parity(rank: int, world: int, dp: str) -> dict:
    """Every mode of MODES and diloco, with and without sequence parallel, beside its eager references."""
    dp = int(dp)
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    base, data = base_model(), batches(dp)
    out: dict = {"dp": dp, "tp": world // dp}
    for sp in (False, True):
        runs = {mode: traced(base, mesh, sp, data, mode) for mode in MODES}
        runs["zero3, least memory"] = traced(base, mesh, sp, data, "zero3", Execution(memory_budget=0.0))
        runs["eager averaged"] = eager_averaged(base, mesh, sp, data)
        runs["eager fsdp2"] = eager_fsdp2(base, mesh, sp, data)
        runs["diloco"] = traced(base, mesh, sp, data, "diloco", sync_every=H)
        runs["eager diloco"] = eager_diloco(base, mesh, sp, data)
        if sp and dp > 1:  # Streaming DiLoCo at dp=2 under sequence parallel only, to keep the jobs short
            runs["streaming_diloco"] = traced(base, mesh, sp, data, "streaming_diloco", **STREAM)
            runs["eager streaming"] = eager_diloco(base, mesh, sp, data, runs["streaming_diloco"]["fragments"])
        whole = single_process(base, data)
        runs["single process"] = {"losses": whole["losses"], "params": shards_of(whole["params"], base, mesh, sp)}
        out["sp" if sp else "plain"] = runs
    return out


class HFCausalLM(torch.nn.Module):
    """A Hugging Face causal LM whose forward returns its own loss (labels = inputs)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def hf_llama() -> HFCausalLM:
    """transformers' Llama, a tiny config (no download), attention in eager PyTorch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return HFCausalLM(LlamaForCausalLM(config))


def hf_plan(model: HFCausalLM) -> dict:
    """The plan a user writes for Hugging Face's Llama: heads and MLP hidden units split, as torchtitan's."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.model.layers)):
        prefix = f"model.model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return plan


def hugging_face(rank: int, world: int, dp: str) -> dict:
    """Hugging Face's tiny Llama under a plan: fused_allreduce and zero3 against eager TP averaged over dp."""
    dp = int(dp)
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    base = hf_llama()
    dpr = mesh["dp"].get_local_rank()
    tokens = [b[dpr][0] for b in batches(dp)][:5]
    runs = {}
    for how in ("fused_allreduce", "zero3", "eager averaged"):
        model = copy.deepcopy(base)
        parallelize_module(model, mesh["tp"], hf_plan(model))
        optimizer = adamw(model.parameters())
        losses = []
        if how == "eager averaged":
            for x in tokens:
                optimizer.zero_grad()
                loss = model(x)
                loss.backward()
                average_over_dp(model, mesh)
                optimizer.step()
                losses.append(loss.item())
            runs[how] = {"losses": losses, "params": {n: local(p) for n, p in model.named_parameters()}}
            continue
        step = transpile(model, optimizer, how, None, (tokens[0],), mesh=mesh["dp"])
        losses = [float(step(x)) for x in tokens]
        with step.gathered():
            runs[how] = {"losses": losses, "params": {n: local(p) for n, p in model.named_parameters()}}
    return runs


def refusals(rank: int, world: int) -> dict:
    """What does not run beside a plan, each as the error a user gets (its type and message), and what works
    between steps: calling the model eagerly, and the collectives each program runs per mesh dimension."""
    from bench.tiny_models import Lamb
    from transpiler import AdaSum, Clipping, DataParallel, FaultTolerance, PassPipeline, StaticWorld

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    base, data = base_model(), batches(1)
    batch = data[0][0]

    def attempt(build, *, config=None, optimizer=adamw, call=None, **kwargs) -> str:
        model = planned(base, mesh, False) if build else copy.deepcopy(base)
        try:
            step = transpile(model, optimizer(model.parameters()), config or DataParallel(), loss_fn, batch, **kwargs)
            if call is not None:
                call(step)
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    out = {
        "adasum": attempt(True, config=AdaSum(), mesh=mesh["dp"]),
        "spec": attempt(True, config=PassPipeline(spec="scale-loss-grad,allreduce-grads"), mesh=mesh["dp"]),
        "clipping": attempt(True, config=DataParallel(clipping=Clipping(max_norm=1.0)), mesh=mesh["dp"]),
        "fault tolerance": attempt(True, mesh=mesh["dp"], fault_tolerance=FaultTolerance(lighthouse="http://x:1")),
        "muon": attempt(True, optimizer=lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2]), mesh=mesh["dp"]),
        "lamb": attempt(True, optimizer=lambda ps: Lamb(ps, lr=1e-2), mesh=mesh["dp"]),
        "no mesh": attempt(True),
        "2-D mesh": attempt(True, mesh=mesh),
        "no plan": attempt(False, mesh=mesh["dp"]),
        "static world": attempt(True, mesh=StaticWorld(size=2)),
        "checkpoint": attempt(True, mesh=mesh["dp"], call=lambda step: step.save_checkpoint("/nonexistent/ckpt")),
    }
    reference = planned(base, mesh, True)
    model = planned(base, mesh, True)
    step = transpile(model, adamw(model.parameters()), "zero2", loss_fn, batch, mesh=mesh["dp"])
    with torch.no_grad():
        out["eager before a step"] = torch.equal(model(batch[0]), reference(batch[0]))
    step(*batch)
    with torch.no_grad():
        out["eager after a step"] = torch.equal(model(batch[0]), reference(batch[0]))  # False: it trained
    out["collectives"] = [
        (n.target.__name__.split(".")[0], n.meta.get("mesh_dim", "dp"), n.meta.get("role"))
        for n in step.program.graph.nodes
        if n.op == "call_function"
        and n.target.__module__ is not None
        and "_c10d_functional" in str(n.target)
        and "wait" not in str(n.target)
    ]
    out["parameters"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    return out


if __name__ == "__main__":
    run_rank(lambda rank, world, *args: parity(rank, world, *args))
