"""One rank of the DiLoCo runs (launched by tests/test_diloco.py), every rank on its own data.

1. ``reference``: ``diloco`` (H=3, AdamW inner, the paper's Nesterov SGD outer) for 3 outer rounds, against an
   eager loop of the paper's Algorithm 1 that this rank runs for *every* replica (each replica's data is made
   here from the seed): H AdamW steps per replica, ``Δ_i = θ_global - θ_i``, the mean ``(Δ_0 + ... + Δ_{W-1}) / W``
   summed in rank order, ``torch.optim.SGD(nesterov=True)`` on θ_global, every replica restarting from it and
   keeping its AdamW state. No collective runs in the reference.
2. ``identity``: an outer SGD with lr 1 and no momentum against ``local_sgd`` with k=H (begin_step=0).
3. ``resume``: ``step.state_dict()`` mid-round, loaded into a fresh model, optimizers and step, continues as
   the run that never stopped.
4. ``global_view``: ``step.global_weights()`` lends θ_global to the model and gives the replica's weights back.
5. ``dcp_resume``: the same through ``step.save_checkpoint()``/``load_checkpoint()``; ``reshard`` (W=4) reads a
   checkpoint of 4 replicas at 2 and one of 2 at 4.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, make_batch  # noqa: E402
from transpiler import DiLoCo, LocalSGD, StreamingDiLoCo, TraceCache, TranspilerError, mode_config, transpile  # noqa: E402

PER_RANK = 8
H = 3
ROUNDS = 3
LOSS = torch.nn.CrossEntropyLoss()


def data(world: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, every replica's batch (replica r's is shard r of the step's global batch)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x, y = make_batch("mlp", PER_RANK * world, gen)
        out.append([(x[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]) for r in range(world)])
    return out


def inner_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class PaperDiLoCo:
    """Algorithm 1 of Douillard et al. (2023), eager, for all ``world`` replicas in this process."""

    def __init__(self, model: torch.nn.Module, replicas: int, outer_lr: float = 0.7, momentum: float = 0.9):
        self.replicas = [copy.deepcopy(model) for _ in range(replicas)]
        self.inner = [inner_optimizer(m.parameters()) for m in self.replicas]
        self.theta = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        self.outer = torch.optim.SGD(self.theta, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
        self.t = 0

    def inner_steps(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each replica's inner step on the batches of its ranks (W / replicas consecutive ones): the gradient
        of each rank's loss times 1/R, summed in rank order (data parallel inside the replica)."""
        size = len(batches) // len(self.replicas)
        for k, (model, opt) in enumerate(zip(self.replicas, self.inner)):
            opt.zero_grad()
            for x, y in batches[k * size : (k + 1) * size]:
                (LOSS(model(x), y) * (1.0 / size)).backward()
            opt.step()

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner_steps(batches)
        self.t += 1
        if self.t % H == 0:
            self.sync()

    def sync(self) -> None:
        """The outer step on the mean Δ, and every replica restarts from θ_global."""
        for i, theta in enumerate(self.theta):
            deltas = [theta.detach() - list(m.parameters())[i].detach() for m in self.replicas]
            total = deltas[0]
            for d in deltas[1:]:
                total = total + d
            theta.grad = total * (1.0 / len(deltas))
        self.outer.step()
        with torch.no_grad():
            for model in self.replicas:
                for p, theta in zip(model.parameters(), self.theta):
                    p.copy_(theta)


class PaperStreaming(PaperDiLoCo):
    """Streaming DiLoCo (Douillard et al., 2025), eager, for all replicas: fragment ``p`` (names in
    ``fragments[p]``) records every replica's ``Δ = θ_global - θ_local`` at the steps ``t ≡ (p+1)·H//P (mod H)``;
    ``delay`` inner steps later its mean goes through the outer SGD (only that fragment's θ_global have a
    gradient), and every replica's fragment becomes ``α·θ_local + (1-α)·θ_global``."""

    def __init__(self, model, replicas, fragments: list[list[str]], sync_every: int, delay: int, alpha: float):
        super().__init__(model, replicas)
        self.names = [n for n, _ in model.named_parameters()]
        self.fragments, self.sync_every, self.delay, self.alpha = fragments, sync_every, delay, alpha
        self.offsets = [(p + 1) * sync_every // len(fragments) for p in range(len(fragments))]
        self.pending: dict[int, dict[str, list[torch.Tensor]]] = {}

    def step(self, batches) -> None:
        self.inner_steps(batches)
        self.t += 1
        for p, offset in enumerate(self.offsets):
            if self.t >= offset and (self.t - offset) % self.sync_every == 0:
                self.pending[p] = {
                    n: [self.theta_of(n) - self.local(m, n) for m in self.replicas] for n in self.fragments[p]
                }
                if not self.delay:
                    self.apply(p)
            started = self.t - self.delay
            if self.delay and started >= offset and (started - offset) % self.sync_every == 0:
                self.apply(p)

    def theta_of(self, name: str) -> torch.Tensor:
        return self.theta[self.names.index(name)].detach().clone()

    @staticmethod
    def local(model, name: str) -> torch.Tensor:
        return dict(model.named_parameters())[name].detach().clone()

    def apply(self, p: int) -> None:
        deltas = self.pending.pop(p)
        for theta in self.theta:
            theta.grad = None
        for name, per_replica in deltas.items():
            total = per_replica[0]
            for d in per_replica[1:]:
                total = total + d
            self.theta[self.names.index(name)].grad = total * (1.0 / len(per_replica))
        self.outer.step()
        with torch.no_grad():
            for model in self.replicas:
                params = dict(model.named_parameters())
                for name in deltas:
                    theta = self.theta[self.names.index(name)]
                    params[name].copy_(self.alpha * params[name] + (1 - self.alpha) * theta)


MLP_FRAGMENTS = [  # MLP's modules by size 672 | 1056, 165: two runs of whole modules, balanced
    ["net.0.weight", "net.0.bias"],
    ["net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias"],
]
STREAM = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}


def streaming(
    rank: int, world: int, traces: TraceCache, replica_size: int = 1, replica_mode: str = "fused_allreduce"
) -> dict:
    torch.manual_seed(0)
    model = MLP()
    paper = PaperStreaming(model, world // replica_size, MLP_FRAGMENTS, 4, 1, 0.5)
    config = mode_config("streaming_diloco", **STREAM, replica_size=replica_size, **inside(replica_mode))
    step = transpile(model, inner_optimizer(model.parameters()), config, loss_fn=LOSS, trace=traces)
    record = {"variants": [], "replica": [], "paper": [], "global": [], "paper_global": []}
    for batches in data(world, 4 * ROUNDS):
        step(*batches[rank])
        paper.step(batches)
        record["variants"].append(step.last_variant)
        record["replica"].append(params_of(model))
        record["paper"].append(params_of(paper.replicas[rank // replica_size]))
        record["global"].append({n: t.clone() for n, t in step.global_parameters().items()})
        record["paper_global"].append({n: t.detach().clone() for n, t in zip(record["paper"][-1], paper.theta)})
    record["collectives"] = {v: collectives(p) for v, p in step.programs.items()}
    record["messages"] = {
        v: [n.meta["collective"]["bytes"] for n in p.graph.nodes if "collective" in n.meta]
        for v, p in step.programs.items()
    }
    return record


def quantised(rank: int, world: int, exchange: str, traces: TraceCache) -> dict:
    """One fragment (P=1), H=2, τ=0, plain SGD inside and outer SGD(lr=1): after the sync every replica holds
    ``θ_global - (sum of Δ over ranks, as exchanged) / W``. Returns that and every replica's Δ, computed eagerly
    here for all replicas, for the test's numpy reference of the exchange."""
    torch.manual_seed(0)
    model = MLP()
    replicas = [copy.deepcopy(model) for _ in range(world)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    start = params_of(model)
    step = transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        StreamingDiLoCo(sync_every=2, fragments=1, exchange_dtype=exchange),
        loss_fn=LOSS,
        outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        trace=traces,
    )
    for batches in data(world, 2):
        step(*batches[rank])
        for m, opt, (x, y) in zip(replicas, inner, batches):
            opt.zero_grad()
            LOSS(m(x), y).backward()
            opt.step()
    deltas = [torch.cat([(start[n] - p.detach()).reshape(-1) for n, p in m.named_parameters()]) for m in replicas]
    bytes_sent = [n.meta["collective"]["bytes"] for n in step.programs["sync0"].graph.nodes if "collective" in n.meta]
    return {"start": start, "after": params_of(model), "deltas": deltas, "wire_bytes": bytes_sent}


def inside(replica_mode: str) -> dict:
    """The option that picks how a replica's ranks share its training (the default left out)."""
    return {} if replica_mode == "fused_allreduce" else {"replica_mode": replica_mode}


def reference(
    rank: int, world: int, traces: TraceCache, replica_size: int = 1, replica_mode: str = "fused_allreduce"
) -> dict:
    torch.manual_seed(0)
    model = MLP()
    paper = PaperDiLoCo(model, world // replica_size)
    config = DiLoCo(sync_every=H, replica_size=replica_size, **inside(replica_mode))
    inner = inner_optimizer(model.parameters())
    step = transpile(model, inner, config, loss_fn=LOSS, trace=traces)
    record = side_by_side(step, model, paper, data(world, H * ROUNDS), rank, rank // replica_size)
    record["collectives"] = {v: collectives(p) for v, p in step.programs.items()}
    record["moment_elements"] = sum(s["exp_avg"].numel() for s in inner.state.values())  # ZeRO: this rank's shard
    return record


def side_by_side(step, model: torch.nn.Module, paper: PaperDiLoCo, steps: list, rank: int, replica: int) -> dict:
    """``step`` on this rank's batches and ``paper`` on everyone's, step by step: the program variant run, this
    rank's weights and θ_global, and those of its replica (``replica``) in the paper's loop."""
    record: dict = {"variants": [], "replica": [], "paper": [], "global": [], "paper_global": []}
    for batches in steps:
        step(*batches[rank])
        paper.step(batches)
        record["variants"].append(step.last_variant)
        record["replica"].append(params_of(model))
        record["paper"].append(params_of(paper.replicas[replica]))
        record["global"].append({n: t.clone() for n, t in step.global_parameters().items()})
        record["paper_global"].append({n: t.detach().clone() for n, t in zip(record["paper"][-1], paper.theta)})
    return record


def collectives(program) -> int:
    return sum(1 for n in program.graph.nodes if "collective" in n.meta)


def each_run(rank: int, world: int, rounds: int, builds: dict[str, Callable[[torch.nn.Module], Any]]) -> dict:
    """Each step ``builds`` names (a label, and what builds it on a model) from seed 0's MLP, on the same ``rounds``
    rounds of batches: per step, the program variant run and this rank's weights."""
    torch.manual_seed(0)
    base = MLP()
    runs = {}
    for label, build in builds.items():
        model = copy.deepcopy(base)
        step = build(model)
        runs[label] = []
        for batches in data(world, H * rounds):
            step(*batches[rank])
            runs[label].append((step.last_variant, params_of(model)))
    return runs


def identity(rank: int, world: int, traces: TraceCache) -> dict:
    """Outer SGD(lr=1, no momentum) makes θ_global - mean(θ_global - θ_i) = mean(θ_i): LocalSGD's average."""

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def diloco(model):
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        return transpile(model, sgd(model), DiLoCo(sync_every=H), LOSS, outer_optimizer=outer, trace=traces)

    def local_sgd(model):
        return transpile(model, sgd(model), LocalSGD(adaptive=False, k_steps=H, begin_step=0), LOSS, trace=traces)

    return each_run(rank, world, ROUNDS, {"diloco": diloco, "local_sgd": local_sgd})


def alpha_one(rank: int, world: int, traces: TraceCache) -> dict:
    """α=1 keeps the local weights at every sync: each replica trains as if alone (its eager AdamW run)."""
    torch.manual_seed(0)
    model = MLP()
    alone = copy.deepcopy(model)
    alone_opt = inner_optimizer(alone.parameters())
    config = mode_config("streaming_diloco", **(STREAM | {"fragment_update_alpha": 1.0}))
    step = transpile(model, inner_optimizer(model.parameters()), config, loss_fn=LOSS, trace=traces)
    record = []
    for batches in data(world, 4 * ROUNDS):
        step(*batches[rank])
        x, y = batches[rank]
        alone_opt.zero_grad()
        LOSS(alone(x), y).backward()
        alone_opt.step()
        record.append((step.last_variant, params_of(model), params_of(alone)))
    return {
        "steps": record,
        "global_moved": any(not torch.equal(step.global_parameters()[n], p) for n, p in record[0][1].items()),
    }


def resume(rank: int, world: int, mode: str, save_after: int, traces: TraceCache, via: str = "state_dict") -> dict:
    """``save_after`` steps, then ``step.state_dict()`` (``via="state_dict"``) or ``step.save_checkpoint()``
    (``"dcp"``, at the first step from ``save_after`` on that ``checkpoint_blocked()`` allows), then a fresh
    model, optimizers and step load it and go on."""
    torch.manual_seed(0)
    options = {"sync_every": H} if mode == "diloco" else STREAM
    steps = data(world, 3 * 4)
    folder = Path(sys.argv[1]) / f"resume-{mode}-{via}"
    runs: dict = {"blocked": []}
    saved: dict = {}
    saved_at = None
    for how in ("straight", "resumed"):
        model = MLP()
        config = mode_config(mode, **options)
        step = transpile(model, inner_optimizer(model.parameters()), config, loss_fn=LOSS, trace=traces)
        if how == "resumed":
            step.load_state_dict(saved) if via == "state_dict" else step.load_checkpoint(folder)
        runs[how] = []
        for t, batches in enumerate(steps, start=1):
            if how == "resumed" and t <= saved_at:
                continue
            step(*batches[rank])
            runs[how].append(params_of(model) | {f"global.{n}": v.clone() for n, v in step.global_parameters().items()})
            if how == "straight" and saved_at is None and t >= save_after:
                if via == "dcp" and step.checkpoint_blocked() is not None:
                    runs["blocked"].append(expect_error(lambda s=step: s.save_checkpoint(folder)))
                    continue
                runs["saved_after"], saved_at = step.last_variant, t
                saved = step.state_dict() if via == "state_dict" else step.save_checkpoint(folder)
                torch.manual_seed(1)  # the resumed model starts from other weights: the load must set them all
        runs[how + "_outer"] = {
            k: v.clone() for k, v in step.outer_optimizer.state[next(iter(model.parameters()))].items()
        }
    runs["saved_keys"] = sorted(saved or {})
    runs["saved_at"] = saved_at
    return runs


def expect_error(fn) -> dict:
    try:
        fn()
    except TranspilerError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": "no error"}


def held(step, model: torch.nn.Module) -> dict:
    """What a DiLoCo step holds on this rank: weights, θ_global, inner and outer state, the inner state's
    slices (``replica_mode=zero*``) and the schedule."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in step.optimizer.state.items()}
    outer = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in step.outer_optimizer.state.items()}
    return {
        "params": params_of(model),
        "global": {n: t.clone() for n, t in step.global_parameters().items()},
        "inner": state,
        "outer": outer,
        "shards": dict(step.program.shards),
        "schedule": step.schedule.state_dict(),
    }


def reshard(rank: int, world: int, traces: TraceCache) -> dict:
    """W=4, one step into the second round: a ``diloco`` checkpoint of 4 replicas read by 2 replicas of 2 ranks
    with ZeRO-1 inside (built first, so each rank reads only its slices), and one of 2 such replicas read by 4;
    what each rank holds after the load, and after one more step."""
    out = {}
    steps = data(world, H + 2)
    for name, saving, loading in (
        ("4to2", {}, {"replica_size": 2, "replica_mode": "zero1"}),
        ("2to4", {"replica_size": 2, "replica_mode": "zero1"}, {}),
    ):
        folder = Path(sys.argv[1]) / f"reshard-{name}"
        torch.manual_seed(0)
        model = MLP()
        config = DiLoCo(sync_every=H, **saving)
        step = transpile(model, inner_optimizer(model.parameters()), config, loss_fn=LOSS, trace=traces)
        for batches in steps[: H + 1]:
            step(*batches[rank])
        step.save_checkpoint(folder)
        out[name] = {"saved": held(step, model), "folder": str(folder)}
        torch.manual_seed(1)
        model = MLP()
        config = DiLoCo(sync_every=H, **loading)
        inner = inner_optimizer(model.parameters())
        step = transpile(model, inner, config, loss_fn=LOSS, example_inputs=steps[-1][rank], trace=traces)
        step.load_checkpoint(folder)
        out[name]["loaded"] = held(step, model)
        step(*steps[-1][rank])
        out[name]["stepped"] = params_of(model)
    return out


def global_view(rank: int, world: int, traces: TraceCache) -> dict:
    torch.manual_seed(0)
    model = MLP()
    step = transpile(model, inner_optimizer(model.parameters()), DiLoCo(sync_every=H), LOSS, trace=traces)
    for batches in data(world, H + 1):  # one inner step past the sync: replica and global weights differ
        step(*batches[rank])
    replica = params_of(model)
    global_ = {n: t.clone() for n, t in step.global_parameters().items()}
    with step.global_weights() as lent:
        inside = params_of(lent)
    return {"replica": replica, "global": global_, "inside": inside, "after": params_of(model)}


def checks(rank: int, world: int, only: str = "") -> dict:
    """Every check's run at this world size; ``only="papers"``: the two runs against the papers' algorithms alone
    (the quick tier, tests/test_quick_worlds.py)."""
    traces = TraceCache()  # every run here trains the MLP with AdamW or SGD: they share their traces
    out = {"reference": reference(rank, world, traces), "streaming": streaming(rank, world, traces)}
    if only == "papers":
        return out
    out["quantised"] = {x: quantised(rank, world, x, traces) for x in ("bfloat16", "float8_e4m3fn", "int4")}
    if world == 4:  # two replicas of two ranks: data parallel inside each (all-reduce, ZeRO-1, ZeRO-2), DiLoCo across
        out |= {"reference_2d": reference(rank, world, traces, 2), "streaming_2d": streaming(rank, world, traces, 2)}
        out["reference_2d_zero1"] = reference(rank, world, traces, 2, "zero1")
        out["streaming_2d_zero2"] = streaming(rank, world, traces, 2, "zero2")
        out["reshard"] = reshard(rank, world, traces)
    if world == 2:
        out |= {"identity": identity(rank, world, traces), "alpha_one": alpha_one(rank, world, traces)}
        out["resume"] = resume(rank, world, "diloco", H + 1, traces)  # one inner step into the second round
        out["resume_in_flight"] = resume(rank, world, "streaming_diloco", 2, traces)  # fragment 0's exchange in flight
        out["dcp_resume"] = resume(rank, world, "diloco", H + 1, traces, via="dcp")
        out["dcp_resume_in_flight"] = resume(rank, world, "streaming_diloco", 2, traces, via="dcp")  # saved once landed
        out["global_view"] = global_view(rank, world, traces)
    return out


if __name__ == "__main__":
    run_rank(checks)
