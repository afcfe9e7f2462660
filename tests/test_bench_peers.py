"""The peers bench/peers.py times the modes against, written from their authors' code (tplr's SparseLoCo loop,
bloc97's DeMo), compute what the modes compute, bit for bit, step after step, on real ranks (gloo, W=2, each rank
its own batches): so their rows compare two ways of doing the same arithmetic. The modes themselves are held to
the authors' formulas in tests/test_sparseloco.py and tests/test_demo.py; this holds the bench's eager loops to the
modes. Bitwise on the CPU (any ATen kernel set): the same ops on the same values in the same order, the ranks'
values meeting in rank order in both. About 15 s on 2 cores. Last, statically, that torchft's Streaming DiLoCo
row syncs the fragments the mode syncs (about 3 s)."""

from __future__ import annotations

import pytest
import torch

from tests.peer_worker import STEPS, SYNC_EVERY
from tests.worlds import run_in_world


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_in_world(2, "tests.peer_worker:checks", tmp_path_factory.mktemp("peers"))


@pytest.mark.bitwise
@pytest.mark.parametrize("mode", ["sparseloco", "demo"])
def test_the_bench_peer_steps_as_the_mode(ranks, mode):
    for record in ranks:
        run = record[mode]
        assert len(run["ours"]) == STEPS
        for t, (ours, peer) in enumerate(zip(run["ours"], run["peer"]), start=1):
            for name, value in ours.items():
                diff = (value - peer[name]).abs().max().item()
                assert torch.equal(value, peer[name]), f"{mode}, step {t}, {name}: {diff:.3g}"
    for t, (first, second) in enumerate(zip(*(r[mode]["ours"] for r in ranks)), start=1):
        synced = mode == "demo" or t % SYNC_EVERY == 0  # demo exchanges every step; sparseloco every SYNC_EVERY
        same = all(torch.equal(first[n], second[n]) for n in first)
        assert same == synced, f"{mode}, step {t}: the ranks {'differ' if synced else 'agree'} (each its own batches)"


def test_torchft_streaming_peer_syncs_the_fragments_the_mode_syncs():
    """bench/peers_torchft.py hands torchft's DiLoCo the mode's own fragments: every parameter in exactly one, the
    model's own parameter objects, and each fragment the parameters one sync program of ``streaming_diloco`` sends
    (read from its collectives' ``pseudo-gradients``). Static (no world, no torchft). About 3 s."""
    from torch import nn

    from bench.models import NarrowGPT, narrow_batch
    from bench.peers import STREAMING
    from bench.peers_torchft import _fragments
    from transpiler import StaticWorld, transpile

    torch.manual_seed(0)
    model = NarrowGPT()
    names = {id(p): n for n, p in model.named_parameters()}
    parts = [[names[id(p)] for p in part.parameters()] for part in _fragments(model, STREAMING.fragments)]
    assert sorted(n for part in parts for n in part) == sorted(names.values()) and all(parts)
    batch = narrow_batch("gpt", 2, torch.Generator().manual_seed(0))
    world = StaticWorld(size=2, rank=0)
    step = transpile(model, torch.optim.AdamW(model.parameters()), STREAMING, nn.CrossEntropyLoss(), batch, mesh=world)
    sent = []
    for variant in ("sync0", "sync1"):
        nodes = step.programs[variant].graph.nodes
        sent.append([n for node in nodes for n in node.meta.get("collective", {}).get("pseudo-gradients", ())])
    assert [sorted(s) for s in sent] == [sorted(p) for p in parts]
