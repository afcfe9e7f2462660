"""One rank of the multi-host parity runs (tests/test_multihost.py): started by torchrun on 2 hosts × 2 processes
(network namespaces) and by tests/distributed.launch on 1 host × 4 (loopback). Each rank trains the same modes on
its shard of the same batches and saves the final parameters and where it ran."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness.launch import run_rank  # noqa: E402
from bench.tiny_models import MLP, make_batch  # noqa: E402
from transpiler import mode_config, transpile  # noqa: E402

PER_RANK, STEPS = 4, 5
MODES = {  # mode: (optimizer, options); hierarchical AdaSum's local groups are the processes of one host
    "fused_allreduce": ("adamw", {"bucket_cap_mb": 0.004}),
    "zero2": ("adamw", {"bucket_cap_mb": 0.004}),
    "adasum": ("sgd", {"local_size": 2}),
}


def train(mode: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    optimizer_name, options = MODES[mode]
    torch.manual_seed(0)
    model = MLP()
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = transpile(model, optimizer, mode_config(mode, **options), loss_fn=torch.nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(11)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for _ in range(STEPS):
        x, y = make_batch("mlp", PER_RANK * world, gen)
        step(x[shard], y[shard])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def checks(rank: int, world: int) -> dict:
    where = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {"where": where, "params": {mode: train(mode, rank, world) for mode in MODES}}


if __name__ == "__main__":
    run_rank(checks)
