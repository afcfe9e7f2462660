"""One rank of the pipeline runs (launched by tests/test_pipeline.py): the bench's narrow GPT cut into as many
stages as the world has ranks, trained ``STEPS`` AdamW steps on the same batches

* by ``transpile(..., pipeline=PipelineParallel(...))``, under each schedule;
* by ``torch.distributed.pipelining``: a hand-built ``PipelineStage`` per rank holding the same modules
  (``bench/models.py``'s ``NarrowGPTStage``), under
  ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1's order)
  with the same microbatches and loss, and torch's AdamW on the stage's parameters;
* by one process training the whole model with gradient accumulation over the same microbatches, as a user
  would write it: each microbatch's loss backpropagated, the gradients divided by the count, one update.

Each run records the loss of every step (the last stage's; the traced step returns it on every rank) and the
stage's parameters at the end.
"""

from __future__ import annotations

import io
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.models import NarrowGPT, NarrowGPTStage, narrow_batch, pipelining_step  # noqa: E402
from transpiler import (  # noqa: E402
    CheckpointError,
    Clipping,
    DataParallel,
    Execution,
    PipelineParallel,
    RankMismatchError,
    mode_config,
    transpile,
)

STEPS = 10
BLOCKS = 4  # a build costs in proportion to the blocks (each stage traces them all): one a stage at 4 stages
BATCH = 12
MAX_NORM = 0.2  # below every step's norm here: each step is clipped


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def base_model() -> NarrowGPT:
    torch.manual_seed(0)
    return NarrowGPT(blocks=BLOCKS)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [narrow_batch("gpt", BATCH, gen) for _ in range(STEPS)]


def stage_names(model: nn.Module, stage: int, stages: int) -> list[str]:
    """The parameters stage ``stage`` holds when the blocks are cut into equal runs (the default split)."""
    per = BLOCKS // stages
    first, last = stage * per, (stage + 1) * per
    names = [f"blocks.{b}." for b in range(first, last)]
    names += ["embed.", "pos"] if stage == 0 else []
    names += ["norm.", "head."] if stage == stages - 1 else []
    return [n for n, _ in model.named_parameters() if any(n == p or n.startswith(p) for p in names)]


def chunk_names(model: nn.Module, rank: int, ranks: int, virtual: int) -> list[str]:
    """The parameters rank ``rank`` holds when the blocks are cut into ``ranks * virtual`` equal chunks, chunk ``c``
    on rank ``c % ranks``."""
    chunks = ranks * virtual
    return [n for c in range(rank, chunks, ranks) for n in stage_names(model, c, chunks)]


def interleaved(rank: int, world: int, microbatches: str) -> dict:
    """Two chunks per rank under ``interleaved_1f1b``, traced; torch's ``ScheduleInterleaved1F1B`` over a
    ``PipelineStage`` per chunk; and the accumulated single process: the rank's chunks' parameters and losses."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    m, virtual, chunks = int(microbatches), 2, 2 * world
    points = tuple(f"blocks.{k * BLOCKS // chunks}" for k in range(1, chunks))
    model = base_model()
    pipeline = PipelineParallel(
        stages=world, microbatches=m, schedule="interleaved_1f1b", virtual_stages=virtual, split_points=points
    )
    step = transpile(model, adamw(model.parameters()), "none", loss_fn, batches()[0], pipeline=pipeline)
    losses = [step(*batch).item() for batch in batches()]
    names = chunk_names(model, rank, world, virtual)
    out = {"traced": {"losses": losses, "params": parameters_of(model, names)}, "order": step.program.decisions}
    model = base_model()
    stages = [
        PipelineStage(NarrowGPTStage(model, c, chunks), c, chunks, torch.device("cpu"))
        for c in range(rank, chunks, world)
    ]
    runner = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    optimizer = adamw([p for n, p in model.named_parameters() if n in names])
    losses = []
    for batch in batches():
        optimizer.zero_grad()
        loss = pipelining_step(runner, rank, world, batch, m)
        losses += [loss] if loss is not None else []
        optimizer.step()
    out["torch"] = {"losses": losses, "params": parameters_of(model, names)}
    out["accumulated"] = accumulated(rank, world, m, names=names)
    dist.barrier()
    return out


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets)


def parameters_of(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    return {n: named[n].detach().clone() for n in names}


def traced(rank: int, world: int, schedule: str, microbatches: int) -> dict:
    model = base_model()
    data = batches()
    step = transpile(
        model,
        adamw(model.parameters()),
        "none",
        loss_fn,
        data[0],
        pipeline=PipelineParallel(stages=world, microbatches=microbatches, schedule=schedule),
    )
    losses = [step(*batch).item() for batch in data]
    return {"losses": losses, "params": parameters_of(model, stage_names(model, rank, world))}


def torch_pipelining(rank: int, world: int, schedule: str, microbatches: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble

    model = base_model()
    module = NarrowGPTStage(model, rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    if schedule == "zbh1":  # torch's zero-bubble schedule at one stage per rank: ZB-H1's order
        runner = ScheduleInterleavedZeroBubble([stage], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        runner = kind(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    names = stage_names(model, rank, world)
    optimizer = adamw([p for n, p in model.named_parameters() if n in names])
    losses = []
    for batch in batches():
        optimizer.zero_grad()
        loss = pipelining_step(runner, rank, world, batch, microbatches)
        losses += [loss] if loss is not None else []
        optimizer.step()
    return {"losses": losses, "params": parameters_of(model, names)}


def accumulated(
    rank: int, world: int, microbatches: int, max_norm: float | None = None, names: list[str] | None = None
) -> dict:
    """One process, the whole model, gradient accumulation over the same microbatches (``max_norm``: then
    ``clip_grad_norm_`` over the whole model, its norms in ``"norms"``); the parameters ``names`` (the stage's)."""
    model = base_model()
    optimizer = adamw(model.parameters())
    losses, norms = [], []
    for tokens, targets in batches():
        optimizer.zero_grad()
        parts = [
            loss_fn(model(x), y) for x, y in zip(tokens.tensor_split(microbatches), targets.tensor_split(microbatches))
        ]
        for part in parts:
            part.backward()
        for p in model.parameters():
            p.grad.div_(microbatches)
        if max_norm is not None:
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        losses.append((sum(parts[1:], parts[0]) / microbatches).item())
    names = stage_names(model, rank, world) if names is None else names
    return {"losses": losses, "norms": norms, "params": parameters_of(model, names)}


def clipped(rank: int, world: int, microbatches: str) -> dict:
    """Clipping by the whole model's norm under 1F1B (each stage's norms met over the pipeline), and one process
    accumulating the same microbatches, then ``clip_grad_norm_``."""
    m = int(microbatches)
    model = base_model()
    data = batches()
    config = DataParallel(clipping=Clipping(max_norm=MAX_NORM))
    pipeline = PipelineParallel(stages=world, microbatches=m)
    step = transpile(model, adamw(model.parameters()), config, loss_fn, data[0], pipeline=pipeline)
    losses, norms = [], []
    for batch in data:
        losses.append(step(*batch).item())
        norms.append(step.last_metrics["grad_norm"])
    traced_run = {"losses": losses, "norms": norms, "params": parameters_of(model, stage_names(model, rank, world))}
    dist.barrier()
    return {"traced": traced_run, "accumulated": accumulated(rank, world, m, MAX_NORM)}


# fused_allreduce and zero3 across dp beside a pipeline: tests/test_pipeline_3d.py (with a tensor-parallel plan)
DP_MODES = ("zero1", "zero2")


def dp_batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11 + dp_rank)
    return [narrow_batch("gpt", BATCH, gen) for _ in range(STEPS)]


def traced_beside_dp(mesh, mode: str, schedule: str, microbatches: int, max_norm: float | None = None) -> dict:
    """This project's pipeline on ``mesh["pp"]``, ``mode`` across ``mesh["dp"]`` (``max_norm``: clipped)."""
    model = base_model()
    data = dp_batches(mesh["dp"].get_local_rank())
    stages, stage = mesh["pp"].size(), mesh["pp"].get_local_rank()
    pipeline = PipelineParallel(stages=stages, microbatches=microbatches, schedule=schedule)
    config = mode if max_norm is None else mode_config(mode, clipping=Clipping(max_norm=max_norm))
    step = transpile(model, adamw(model.parameters()), config, loss_fn, data[0], mesh=mesh, pipeline=pipeline)
    losses = [step(*batch).item() for batch in data]
    with step.gathered():
        params = parameters_of(model, stage_names(model, stage, stages))
    return {"losses": losses, "params": params}


def torch_beside_dp(mesh, schedule: str, microbatches: int, max_norm: float | None = None) -> dict:
    """torch's pipelining on ``mesh["pp"]``, each stage's gradients averaged over ``mesh["dp"]`` here (what DDP
    does: each divided by the group's size, then summed), then AdamW. ``max_norm``: first clipped by the whole
    model's norm, from its definition: each gradient's norm (``_foreach_norm``, as ``clip_grad_norm_``), every
    stage's gathered over ``pp`` in stage order (model order here), their 2-norm; then ``clip_grad_norm_``'s
    coefficient."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages, stage_index = mesh["pp"].size(), mesh["pp"].get_local_rank()
    dp_group, dp = mesh["dp"].get_group(), mesh["dp"].size()
    model = base_model()
    stage = PipelineStage(NarrowGPTStage(model, stage_index, stages), stage_index, stages, torch.device("cpu"),
                          group=mesh["pp"].get_group())  # fmt: skip
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, microbatches, loss_fn=loss_fn)
    names = stage_names(model, stage_index, stages)
    params = [p for n, p in model.named_parameters() if n in names]
    optimizer = adamw(params)
    losses = []
    for batch in dp_batches(mesh["dp"].get_local_rank()):
        optimizer.zero_grad()
        loss = pipelining_step(runner, stage_index, stages, batch, microbatches)
        losses += [loss] if loss is not None else []
        for p in params:
            p.grad.div_(dp)
            dist.all_reduce(p.grad, group=dp_group)
        if max_norm is not None:
            clip_over_stages([p.grad for p in params], max_norm, mesh["pp"].get_group())
        optimizer.step()
    return {"losses": losses, "params": parameters_of(model, names)}


def clip_over_stages(grads: list[torch.Tensor], max_norm: float, pp_group) -> None:
    mine = torch.stack(torch._foreach_norm(grads))
    every = [torch.empty(0)] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, mine, group=pp_group)
    total = torch.linalg.vector_norm(torch.cat(every))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def beside_dp(rank: int, world: int, microbatches: str) -> dict:
    """dp=2 × pp=world/2: every mode of DP_MODES across ``dp`` beside torch's pipelining averaged over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh

    m = int(microbatches)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "dp"))
    out = {mode: traced_beside_dp(mesh, mode, "1f1b", m) for mode in DP_MODES}
    out["torch 1f1b, averaged over dp"] = torch_beside_dp(mesh, "1f1b", m)
    out["zero2 clipped"] = traced_beside_dp(mesh, "zero2", "1f1b", m, MAX_NORM)
    out["torch 1f1b, averaged over dp, clipped"] = torch_beside_dp(mesh, "1f1b", m, MAX_NORM)
    out["stage"] = mesh["pp"].get_local_rank()
    dist.barrier()
    return out


def batch_norm(rank: int, world: int) -> dict:
    """A ResNet with BatchNorm in every block, cut in two, 5 SGD steps on 3 microbatches: the stage's parameters
    and running statistics, traced and accumulated in one process (each microbatch's forward updates them in
    turn, as the traced stages chain them)."""
    from bench.models import NarrowResNet

    gen = torch.Generator().manual_seed(5)
    data = [narrow_batch("cnn", 12, gen) for _ in range(5)]
    runs = {}
    for label in ("traced", "accumulated"):
        torch.manual_seed(0)
        model = NarrowResNet(blocks=4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if label == "traced":
            pipeline = PipelineParallel(stages=world, microbatches=3)
            step = transpile(model, optimizer, "none", nn.functional.cross_entropy, data[0], pipeline=pipeline)
            for batch in data:
                step(*batch)
        else:
            for images, labels in data:
                optimizer.zero_grad()
                for x, y in zip(images.tensor_split(3), labels.tensor_split(3)):
                    nn.functional.cross_entropy(model(x), y).backward()
                for p in model.parameters():
                    p.grad.div_(3)
                optimizer.step()
        mine = ["stem", "bn", "blocks.0", "blocks.1"] if rank == 0 else ["blocks.2", "blocks.3", "head"]
        runs[label] = {n: t.detach().clone() for n, t in model.state_dict().items() if n.split(".")[0] in mine
                       or ".".join(n.split(".")[:2]) in mine}  # fmt: skip
    return runs


def resumed(rank: int, world: int, microbatches: str) -> dict:
    """10 steps straight, ``step.state_dict()`` taken through ``torch.save`` after 5 of them; a step made from
    another model's initialisation that loads it and runs the last 5; and the error of loading the other stage's
    snapshot."""
    m, data = int(microbatches), batches()
    half = STEPS // 2

    def made(seed: int) -> tuple[nn.Module, object]:
        torch.manual_seed(seed)
        model = NarrowGPT(blocks=BLOCKS)
        pipeline = PipelineParallel(stages=world, microbatches=m)
        return model, transpile(model, adamw(model.parameters()), "none", loss_fn, data[0], pipeline=pipeline)

    model, step = made(0)
    saved = io.BytesIO()
    straight = []
    for k, batch in enumerate(data):
        if k == half:
            torch.save(step.state_dict(), saved)
        straight.append(step(*batch).item())
    out = {"straight": {"losses": straight, "params": parameters_of(model, stage_names(model, rank, world))}}
    model, step = made(1)
    snapshot = torch.load(io.BytesIO(saved.getvalue()))
    step.load_state_dict(snapshot)
    rest = [step(*batch).item() for batch in data[half:]]
    out["resumed"] = {"losses": straight[:half] + rest, "params": parameters_of(model, stage_names(model, rank, world))}
    out["entries"] = sorted(snapshot["model"])
    out["optimizer state"] = len(snapshot["optimizer"]["state"])
    every = [None] * world
    dist.all_gather_object(every, snapshot)
    try:
        step.load_state_dict(every[(rank + 1) % world])
        out["other stage's"] = None
    except CheckpointError as error:
        out["other stage's"] = str(error)
    return out


def compiled(rank: int, world: int, microbatches: str) -> dict:
    """A GPT of 2 blocks in two stages, 6 steps of SGD with momentum eager and with ``compile=True`` (SGD: AdamW
    would turn a gradient's rounding into steps of its learning rate where a gradient is near zero): each run's
    losses and the stage's parameters, how many graphs Dynamo made, and the compile's seconds."""
    m, data = int(microbatches), batches()[:6]
    out = {}
    for label, compile_ in (("eager", False), ("compiled", True)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = NarrowGPT(blocks=2)
        pipeline = PipelineParallel(stages=world, microbatches=m, split_points=("blocks.1",))
        execution = Execution(compile=compile_)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = transpile(model, optimizer, "none", loss_fn, data[0], pipeline=pipeline, execution=execution)
        losses = [step(*batch).item() for batch in data]
        names = [n for n, _ in model.named_parameters() if n.startswith(("embed", "pos", "blocks.0"))]
        if rank == world - 1:
            names = [n for n, _ in model.named_parameters() if n not in names]
        out[label] = {"losses": losses, "params": parameters_of(model, names)}
        out[label]["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out[label]["compile_seconds"] = dict(step.compile_seconds)
    return out


def mismatch(rank: int, world: int) -> dict:
    """Each stage given other microbatches: the error each rank raises before any step."""
    model = base_model()
    pipeline = PipelineParallel(stages=world, microbatches=2 if rank == 0 else 4)
    try:
        transpile(model, adamw(model.parameters()), "none", loss_fn, batches()[0], pipeline=pipeline)
    except RankMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def parity(rank: int, world: int, microbatches: str) -> dict:
    """Every schedule, traced and under torch's pipelining, and the accumulated single process."""
    m = int(microbatches)
    out = {f"traced {s}": traced(rank, world, s, m) for s in ("gpipe", "1f1b", "zbh1")}
    out |= {f"torch {s}": torch_pipelining(rank, world, s, m) for s in ("gpipe", "1f1b", "zbh1")}
    out["accumulated"] = accumulated(rank, world, m)
    dist.barrier()
    return out


if __name__ == "__main__":  # one world by hand: torchrun --nproc-per-node 2 tests/pipeline_worker.py [M] [dp]
    dist.init_process_group("gloo")
    job = beside_dp if sys.argv[2:] == ["dp"] else parity
    result = job(dist.get_rank(), dist.get_world_size(), sys.argv[1] if len(sys.argv) > 1 else "3")
    reference = result.pop("torch gpipe" if job is parity else "torch 1f1b, averaged over dp")
    result.pop("stage", None)
    for name, run in result.items():
        same = all(torch.equal(run["params"][n], v) for n, v in reference["params"].items())
        print(dist.get_rank(), name, "bitwise" if same else "DIFFERS", run["losses"][:3])
    dist.destroy_process_group()
