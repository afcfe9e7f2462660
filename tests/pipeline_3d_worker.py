"""One rank of the three-dimensional runs (launched by tests/test_pipeline_3d.py): a Llama-style model under
torchtitan's tensor-parallel plan on ``mesh["tp"]``, cut into stages on ``mesh["pp"]``, a data-parallel mode
across ``mesh["dp"]``; beside the eager run a user would otherwise make from the same weights and batches (eager
TP inside ``torch.distributed.pipelining``'s stages, each shard's gradient averaged over ``dp``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.models import TinyLlama, llama_tp_plan  # noqa: E402
from bench.pipeline_3d import EagerThreeD, adamw, loss_fn, split_points  # noqa: E402
from bench.pipeline_3d import single_process as whole_batch  # noqa: E402
from transpiler import ConfigurationError, PipelineParallel, mode_config, transpile  # noqa: E402
from transpiler.graph.collectives import is_collective  # noqa: E402

STEPS = 10
BLOCKS = 2  # one a stage: a build's cost grows with the blocks, and each stage's program has them all
H = 3  # DiLoCo's inner steps per round
PER_RANK, SEQ, VOCAB = 4, 16, 64


def batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7 + dp_rank)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def planned(mesh, sequence_parallel: bool) -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB, dim=32, heads=4, hidden=64, blocks=BLOCKS)
    parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel))
    return model


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def stage_names(model: nn.Module, stage: int, stages: int) -> list[str]:
    per = BLOCKS // stages
    kept = {f"layers.{b}." for b in range(stage * per, (stage + 1) * per)}
    kept |= {"tok_embeddings."} if stage == 0 else set()
    kept |= {"norm.", "output."} if stage == stages - 1 else set()
    return [n for n, _ in model.named_parameters() if any(n.startswith(k) for k in kept)]


def traced(mesh, mode: str, schedule: str, microbatches: int, sp: bool, **options) -> dict:
    """This project's step: the plan across ``tp``, the stages across ``pp``, ``mode`` across ``dp``."""
    model = planned(mesh, sp)
    stages, stage = mesh["pp"].size(), mesh["pp"].get_local_rank()
    data = batches(mesh["dp"].get_local_rank())
    pipeline = PipelineParallel(
        stages=stages, microbatches=microbatches, schedule=schedule, split_points=split_points(stages, BLOCKS)
    )
    config = mode_config(mode, **options)
    step = transpile(
        model, adamw(model.parameters()), config, loss_fn, data[0], mesh=mesh["pp", "dp"], pipeline=pipeline
    )
    losses = [step(*batch).item() for batch in data]
    with step.gathered():
        params = {n: local(p) for n, p in model.named_parameters() if n in stage_names(model, stage, stages)}
    return {"losses": losses, "params": params, "tp reductions": tp_reductions(step.program.graph)}


def tp_reductions(graph) -> int:
    """How many collectives over ``tp`` the step runs once, not per microbatch (the partial gradients' reductions;
    the plan's other collectives belong to a microbatch's forward or backward)."""
    return sum(
        is_collective(n) and n.meta.get("mesh_dim") == "tp" and n.meta.get("microbatch") is None for n in graph.nodes
    )


def eager(mesh, schedule: str, microbatches: int, sp: bool) -> dict:
    """What a user would run instead (torchtitan's layout, ``bench/pipeline_3d.py``'s ``EagerThreeD``): eager TP
    inside ``torch.distributed.pipelining``'s stages on ``mesh["pp"]``, each shard's gradient averaged over
    ``mesh["dp"]`` (a Partial one, a norm's weight under sequence parallel, reduced over ``tp`` first), AdamW."""
    model = planned(mesh, sp)
    run = EagerThreeD(model, mesh, schedule, microbatches)
    losses = [run(*batch) for batch in batches(mesh["dp"].get_local_rank())]
    names = stage_names(model, run.index, run.stages)
    return {
        "losses": [loss for loss in losses if loss is not None],
        "params": {n: local(p) for n, p in model.named_parameters() if n in names},
    }


def eager_diloco(mesh, microbatches: int) -> dict:
    """DiLoCo (Douillard et al. 2023, Algorithm 1) across ``dp`` around eager TP inside torch's pipelining: ``H``
    inner AdamW steps of each replica's stage, then each shard's Δ = θ_global − θ averaged over ``dp`` through the
    paper's outer Nesterov SGD (lr 0.7, momentum 0.9), and θ = θ_global."""
    model = planned(mesh, False)
    run = EagerThreeD(model, mesh, "1f1b", microbatches, average=False)
    params = dict(run.module.named_parameters())
    theta = {n: torch.nn.Parameter(local(p)) for n, p in params.items()}
    outer = torch.optim.SGD(theta.values(), lr=0.7, momentum=0.9, nesterov=True)
    dp, group = mesh["dp"].size(), mesh["dp"].get_group()
    losses = []
    for t, batch in enumerate(batches(mesh["dp"].get_local_rank()), 1):
        losses.append(run(*batch))
        if t % H:
            continue
        for name, p in params.items():
            delta = theta[name].detach() - local(p)
            dist.all_reduce(delta, group=group)
            theta[name].grad = delta * (1.0 / dp)
        outer.step()
        with torch.no_grad():
            for name, p in params.items():
                (p.to_local() if isinstance(p, DTensor) else p).copy_(theta[name])
    return {
        "losses": [loss for loss in losses if loss is not None],
        "params": {n: local(p) for n, p in params.items()},
    }


def single_process(mesh, sp: bool) -> dict:
    """The 1-D run: the unsplit model in one process on every data-parallel rank's batch at once; its losses, and
    this rank's shards of its parameters (cut as the plan cuts them)."""
    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB, dim=32, heads=4, hidden=64, blocks=BLOCKS)
    losses = whole_batch(model, [batches(r) for r in range(mesh["dp"].size())])
    shapes = planned(mesh, sp)
    stages, stage = mesh["pp"].size(), mesh["pp"].get_local_rank()
    names = stage_names(shapes, stage, stages)
    whole = dict(model.named_parameters())
    params = {
        n: distribute_tensor(whole[n].detach(), mesh["tp"], p.placements).to_local() if isinstance(p, DTensor)
        else whole[n].detach().clone()
        for n, p in shapes.named_parameters() if n in names
    }  # fmt: skip
    return {"losses": losses, "params": params}


def refusals(mesh) -> dict[str, str]:
    """What a user gets for the meshes that do not fit a plan beside a pipeline: the whole 3-D mesh, or none."""
    out = {}
    for label, given in {"the 3-D mesh": mesh, "no mesh": None}.items():
        model = planned(mesh, False)
        pipeline = PipelineParallel(stages=2, microbatches=2, split_points=split_points(2, BLOCKS))
        try:
            transpile(model, adamw(model.parameters()), "zero2", loss_fn, mesh=given, pipeline=pipeline)
            out[label] = "accepted"
        except ConfigurationError as error:
            out[label] = str(error)
    return out


def three_d(rank: int, world: int, microbatches: str) -> dict:
    """dp=2 × pp=2 × tp=2 (a world of 8): modes across dp beside their eager references (with and without sequence
    parallel; DiLoCo's from the paper), the 1-D run, and the refusals."""
    m = int(microbatches)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    out = {
        "fused_allreduce": traced(mesh, "fused_allreduce", "1f1b", m, False),
        "eager": eager(mesh, "1f1b", m, False),
        "zero3, sp, zbh1": traced(mesh, "zero3", "zbh1", m, True),
        "eager, sp": eager(mesh, "1f1b", m, True),
        "diloco": traced(mesh, "diloco", "1f1b", m, False, sync_every=H),
        "eager diloco": eager_diloco(mesh, m),
        "single process": single_process(mesh, False),  # the plan splits the same tensors with or without sp
        "refusals": refusals(mesh),
    }
    dist.barrier()
    return out
