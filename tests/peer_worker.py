"""One rank of tests/test_bench_peers.py: each of bench/peers.py's peers written from their authors' code, stepped
beside the mode it is the peer of, from the same weights on the same batches (this rank's own), its parameters
after every step recorded for both."""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.demo_peer import AuthorsDeMo  # noqa: E402
from bench.harness.launch import run_rank  # noqa: E402
from bench.models import NarrowGPT, narrow_batch  # noqa: E402
from bench.sparseloco_peer import TplrDiLoCo, TplrSparseLoCo  # noqa: E402
from transpiler import mode_config, transpile  # noqa: E402

STEPS, SYNC_EVERY = 6, 3
SPARSELOCO = {"outer_lr": 0.8, "error_decay": 0.9, "chunk_size": 8, "topk": 12, "quantization_bins": 4}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _side_by_side(ours, peer, models: tuple[nn.Module, nn.Module], batches: list) -> dict:
    record: dict = {"ours": [], "peer": []}
    for x, y in batches:
        ours(x, y)
        peer(x, y)
        record["ours"].append(_params(models[0]))
        record["peer"].append(_params(models[1]))
    return record


def sparseloco(base: nn.Module, batches: list) -> dict:
    """``sparseloco`` (AdamW inside) against tplr's ``Diloco`` loop with its ``SparseLoCo`` optimizer."""
    mine, theirs = copy.deepcopy(base), copy.deepcopy(base)
    config = mode_config("sparseloco", sync_every=SYNC_EVERY, **SPARSELOCO)
    ours = transpile(mine, torch.optim.AdamW(mine.parameters(), lr=1e-2), config, nn.CrossEntropyLoss())
    o = SPARSELOCO
    outer = TplrSparseLoCo(
        theirs.parameters(), o["outer_lr"], o["error_decay"], o["topk"], o["chunk_size"], o["quantization_bins"], 6.0
    )
    peer = TplrDiLoCo(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2), outer, SYNC_EVERY)
    return _side_by_side(ours, peer, (mine, theirs), batches)


def demo(base: nn.Module, batches: list) -> dict:
    """``demo`` (SGD) against bloc97's ``DeMo`` optimizer in their loop, at the mode's defaults."""
    mine, theirs = copy.deepcopy(base), copy.deepcopy(base)
    ours = transpile(mine, torch.optim.SGD(mine.parameters(), lr=1e-2), "demo", nn.CrossEntropyLoss())
    optimizer, loss_fn = AuthorsDeMo(theirs.parameters(), lr=1e-2), nn.CrossEntropyLoss()

    def peer(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss_fn(theirs(x), y).backward()
        optimizer.step()

    return _side_by_side(ours, peer, (mine, theirs), batches)


def checks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = NarrowGPT(blocks=2, dim=16)
    gen = torch.Generator().manual_seed(rank)
    batches = [narrow_batch("gpt", 4, gen) for _ in range(STEPS)]
    return {"sparseloco": sparseloco(base, batches), "demo": demo(base, batches)}


if __name__ == "__main__":
    run_rank(checks)
