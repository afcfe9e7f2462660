"""One rank of the torch.distributed.checkpoint runs (launched by tests/test_zero.py): a world of 4 writes the
checkpoint that a world of 2 reads. Its own processes, apart from tests/zero_worker.py's: the transpiler imports
torch.distributed.checkpoint only when a checkpoint is written or read (see runtime/distributed_step.py).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.distributed import run_rank  # noqa: E402
from tests.zero_worker import CAPS, OPTIMIZERS, PER_RANK, batches, build_model, largest, state_slices  # noqa: E402
from transpiler import transpile  # noqa: E402


def whole_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state by ``param.key`` as this rank holds it (slices under a sharded mode)."""
    return state_slices(model, optimizer, None)


def fresh_tied(mode: str, example: tuple | None = None):
    torch.manual_seed(4321)  # other weights than the checkpoint's: loading must overwrite them all
    model = build_model("tied")
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    step = transpile(model, optimizer, mode=mode, loss_fn=torch.nn.CrossEntropyLoss(), example_inputs=example, **CAPS)
    return model, optimizer, step


def dcp_checkpoints(rank: int, world: int, root: str) -> dict:
    """torch.distributed.checkpoint: a same-size resume, bitwise (zero3 at W=4, whose parameters are slices
    too; zero1 and zero2 at W=2); at W=4 the checkpoint the other sizes read; at W=2 that checkpoint read into zero3
    (built first: each rank reads only its slices of parameters and state) and into a zero1 step not yet built
    (whole tensors, cut at the first step), each then trained 2 steps next to DDP loaded from the same
    checkpoint with get_state_dict/dcp.load/set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data = batches("tied", world)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out: dict = {"resume": {}}
    for mode in ("zero3",) if world == 4 else ("zero1", "zero2"):
        model, optimizer, step = fresh_tied(mode)
        torch.manual_seed(1234)
        model.load_state_dict(build_model("tied").state_dict())
        for x, y in data[:3]:
            step(x[shard], y[shard])
        path = os.path.join(root, f"dcp_w{world}" + ("" if mode == "zero3" else f"_{mode}"))
        step.save_checkpoint(path)
        if world == 4:  # what the world of 2 and the plain model read
            out["path"] = path
            with step.gathered():
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
            state, shards = whole_state(model, optimizer), dict(step.program.shards)
            out["saved"] = {"params": params, "state": state, "shards": shards}
        for x, y in data[3:]:
            step(x[shard], y[shard])
        model2, optimizer2, step2 = fresh_tied(mode)
        step2.load_checkpoint(path)
        for x, y in data[3:]:
            step2(x[shard], y[shard])
        out["resume"][mode] = {
            "params": largest(dict(model.named_parameters()), dict(model2.named_parameters())),
            "state": largest(whole_state(model, optimizer), whole_state(model2, optimizer2)),
        }
    source = os.path.join(root, "dcp_w4")
    if world == 2 and os.path.exists(source):
        for name, reader, example in (("built", "zero3", tuple(t[shard] for t in data[3])), ("unbuilt", "zero1", None)):
            model3, optimizer3, step3 = fresh_tied(reader, example)
            step3.load_checkpoint(source)
            with step3.gathered():
                loaded = {
                    "params": {n: p.detach().clone() for n, p in model3.named_parameters()},
                    "state": whole_state(model3, optimizer3),
                }
            ddp_model = build_model("tied")
            ddp_opt = OPTIMIZERS["adamw"](ddp_model.parameters())
            msd, osd = get_state_dict(ddp_model, ddp_opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=source)
            set_state_dict(ddp_model, ddp_opt, model_state_dict=msd, optim_state_dict=osd)
            ddp = DDP(ddp_model, gradient_as_bucket_view=True)
            trained = []
            for x, y in data[3:]:
                step3(x[shard], y[shard])
                ddp_opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x[shard]), y[shard]).backward()
                ddp_opt.step()
                with step3.gathered():
                    params = largest(dict(model3.named_parameters()), dict(ddp.module.named_parameters()))
                trained.append(
                    (
                        params,
                        largest(
                            whole_state(model3, optimizer3), state_slices(ddp.module, ddp_opt, step3.program.shards)
                        ),
                    )
                )
            loaded["shards"] = dict(step3.program.shards)
            out[f"reshard_{name}"] = {"loaded": loaded, "trained": trained}
    return out


if __name__ == "__main__":
    run_rank(lambda rank, world, root: dcp_checkpoints(rank, world, root))
