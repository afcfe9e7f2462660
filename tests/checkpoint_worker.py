"""One rank of the torch.distributed.checkpoint runs (launched by tests/test_zero.py), one world per stage of
STAGES in order: worlds of 2, 4, 3 and 2 again, each reading the checkpoint the stage before wrote (2→4, 4→3,
3→2), and the test's own process reads the W=4 and W=3 ones into a plain model (4→1, 3→1). Its own processes,
apart from tests/zero_worker.py's: the transpiler imports torch.distributed.checkpoint only when a checkpoint is
written or read (see runtime/distributed_step.py).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.launch import run_rank  # noqa: E402
from tests.zero_worker import CAPS, OPTIMIZERS, PER_RANK, batches, build_model, largest, state_slices  # noqa: E402
from transpiler import Accumulation, mode_config, transpile  # noqa: E402

# stage: (world size, the stage whose checkpoint it reads, modes whose same-size resume it checks, the mode whose
# checkpoint it leaves for the next stage). W=3's checkpoint is written by its zero3 reader after 2 more steps.
STAGES = {
    "w2": (2, None, ("zero1", "zero2", "zero1+accumulate"), "zero2"),
    "w4": (4, "w2", ("zero3",), "zero3"),
    "w3": (3, "w4", (), "zero3"),
    "w2_from_w3": (2, "w3", (), None),
}


def checkpoint_path(root: str, stage: str) -> str:
    return os.path.join(root, f"dcp_{stage}")


def whole_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state by ``param.key`` as this rank holds it (slices under a sharded mode)."""
    return state_slices(model, optimizer, None)


def fresh_tied(mode: str, example: tuple | None = None):
    """``mode``, or ``<mode>+accumulate``: with two micro-steps per update (a first variant, ``accumulate``, that
    holds no slices under zero1: the checkpoint must take them from the variant that updates)."""
    torch.manual_seed(4321)  # other weights than the checkpoint's: loading must overwrite them all
    model = build_model("tied")
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    mode, _, accumulate = mode.partition("+")
    options = {**CAPS, **({"accumulation": Accumulation(steps=2)} if accumulate else {})}
    step = transpile(
        model, optimizer, mode_config(mode, **options), loss_fn=torch.nn.CrossEntropyLoss(), example_inputs=example
    )
    return model, optimizer, step


def held(model, optimizer, step) -> dict:
    """What this rank holds: the whole parameters (gathered under zero3), its optimizer-state slices and where
    they sit."""
    with step.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "state": whole_state(model, optimizer), "shards": dict(step.program.shards)}


def same_size_resume(mode: str, rank: int, world: int, path: str) -> tuple[dict, dict]:
    """save_checkpoint after 3 steps, 2 more; a fresh model, optimizer and step (other weights) read it back and
    take the same 2 steps. Returns how the two ends compare and what was saved."""
    data, shard = batches("tied", world), slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    model, optimizer, step = fresh_tied(mode)
    torch.manual_seed(1234)
    model.load_state_dict(build_model("tied").state_dict())
    cut = 2 if mode.endswith("+accumulate") else 3  # after a whole accumulation cycle
    for x, y in data[:cut]:
        step(x[shard], y[shard])
    step.save_checkpoint(path)
    saved = held(model, optimizer, step)
    for x, y in data[cut:]:
        step(x[shard], y[shard])
    model2, optimizer2, step2 = fresh_tied(mode)
    step2.load_checkpoint(path)
    for x, y in data[cut:]:
        step2(x[shard], y[shard])
    compared = {
        "params": largest(dict(model.named_parameters()), dict(model2.named_parameters())),
        "state": largest(whole_state(model, optimizer), whole_state(model2, optimizer2)),
    }
    return compared, saved


def reshard(reader: str, source: str, rank: int, world: int, built: bool) -> tuple[dict, list, tuple]:
    """The checkpoint at ``source`` (written at another world size) read into ``reader``, built first (each rank
    reads only its slices) or not (whole tensors, cut at the first step), then trained 2 steps next to DDP
    loaded from the same checkpoint with get_state_dict/dcp.load/set_state_dict. Returns what was loaded, each
    step's comparison with DDP, and the reader (to save it again)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data, shard = batches("tied", world), slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    model, optimizer, step = fresh_tied(reader, tuple(t[shard] for t in data[3]) if built else None)
    step.load_checkpoint(source)
    with step.gathered():
        loaded = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    loaded["state"] = whole_state(model, optimizer)
    ddp_model = build_model("tied")
    ddp_opt = OPTIMIZERS["adamw"](ddp_model.parameters())
    msd, osd = get_state_dict(ddp_model, ddp_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=source)
    set_state_dict(ddp_model, ddp_opt, model_state_dict=msd, optim_state_dict=osd)
    ddp = DDP(ddp_model, gradient_as_bucket_view=True)
    trained = []
    for x, y in data[3:]:
        step(x[shard], y[shard])
        ddp_opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[shard]), y[shard]).backward()
        ddp_opt.step()
        with step.gathered():
            params = largest(dict(model.named_parameters()), dict(ddp.module.named_parameters()))
        state = largest(whole_state(model, optimizer), state_slices(ddp.module, ddp_opt, step.program.shards))
        trained.append((params, state))
    loaded["shards"] = dict(step.program.shards)
    return loaded, trained, (model, optimizer, step)


def local_sgd_refuses(rank: int, world: int) -> dict:
    """A mode that keeps ranks apart between syncs refuses save_checkpoint on every rank, before any
    collective, so the world goes on: an all-reduce after the refusal still sums every rank."""
    from transpiler.errors import CheckpointError

    data, shard = batches("tied", world), slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.manual_seed(1234)
    model = build_model("tied")
    step = transpile(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "local_sgd", loss_fn=torch.nn.CrossEntropyLoss()
    )
    x, y = data[0]
    step(x[shard], y[shard])
    try:
        step.save_checkpoint("/nonexistent/never-written")
        refusal = "saved"
    except CheckpointError as error:
        refusal = str(error)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return {"refusal": refusal, "after": alive.item()}


def dcp_checkpoints(rank: int, world: int, root: str, stage: str) -> dict:
    size, reads, resumes, writes = STAGES[stage]
    assert size == world, (stage, world)
    out: dict = {"resume": {}, "path": checkpoint_path(root, stage)}
    for mode in resumes:
        path = out["path"] if mode == writes else os.path.join(root, f"dcp_{stage}_{mode}")
        out["resume"][mode], saved = same_size_resume(mode, rank, world, path)
        if mode == writes:
            out["saved"] = saved
    if reads is not None:
        out["reshard"] = {}
        for name, reader, built in (("built", "zero3", True), ("unbuilt", "zero1", False)):
            loaded, trained, (model, optimizer, step) = reshard(
                reader, checkpoint_path(root, reads), rank, world, built
            )
            out["reshard"][name] = {"loaded": loaded, "trained": trained}
            if reader == writes and not resumes:  # a checkpoint written after a reshard, of W=3's uneven slices
                step.save_checkpoint(out["path"])
                out["saved"] = held(model, optimizer, step)
    if stage == "w2":
        out["refuses"] = local_sgd_refuses(rank, world)
        out["first"] = saved_before_the_first_step(rank, world, root)
    return out


def saved_before_the_first_step(rank: int, world: int, root: str) -> dict:
    """zero3, each rank's model initialised differently, save_checkpoint before any step: the checkpoint holds rank
    0's weights (the startup ran first, as the first step would have run it), and a step then runs. Returns the
    path, rank 0's initial weights (every rank makes them), this rank's own, and what it holds after that step."""
    data, shard = batches("tied", world), slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.manual_seed(100)
    rank0 = {n: p.detach().clone() for n, p in build_model("tied").named_parameters()}
    torch.manual_seed(100 + rank)
    model = build_model("tied")
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = data[0]
    step = transpile(
        model, OPTIMIZERS["adamw"](model.parameters()), "zero3", torch.nn.CrossEntropyLoss(), (x[shard], y[shard])
    )
    path = os.path.join(root, "dcp_before_the_first_step")
    step.save_checkpoint(path)
    step(x[shard], y[shard])
    with step.gathered():
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"path": path, "rank0": rank0, "mine": mine, "after": after}


if __name__ == "__main__":
    run_rank(lambda rank, world, root, stage: dcp_checkpoints(rank, world, root, stage))
