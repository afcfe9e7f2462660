"""The planner's tensor-parallel degrees (issue 76): a user's plan read against the model, the degrees it weighs or
leaves out with the reason, their price by the stated formula, and the CLI.

Static (the quick tier's: a trace and an eager forward of a small llama each, about 1 s each) except the CLI
(about 3 s). A pick applied and run in a world of two is in tests/test_planner.py's world, with
``tensor_parallel_pick`` below. How close the prices come to measured steps is bench/planner.py's claim, not a
test's.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
import torch
from torch import nn

from bench.models import TinyLlama, llama_tp_plan, next_token_loss
from transpiler import ConfigurationError, transpile
from transpiler.cli import main
from transpiler.graph.collectives import collective_sequence
from transpiler.planner import ComputeTimes, plan, profile_step, simple_cluster
from transpiler.planner.costs import STEPS_FACTORS, Layout, estimate
from transpiler.planner.search import rank
from transpiler.planner.tensor_parallel import tensor_parallel_shape

BATCH, SEQ, DIM, HIDDEN, VOCAB, BLOCKS = 2, 8, 16, 32, 24, 2


def llama() -> tuple:
    model = torch.manual_seed(0) and TinyLlama(vocab=VOCAB, dim=DIM, heads=2, hidden=HIDDEN, blocks=BLOCKS)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), next_token_loss, (tokens, tokens)


@pytest.mark.quick
def test_a_plan_is_read_against_the_model_as_megatron_pairs_exchange():
    model, _, loss_fn, batch = llama()
    shape = tensor_parallel_shape(model, llama_tp_plan(model, sequence_parallel=True), loss_fn, batch)
    linears = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    linears += ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    split = {f"layers.{b}.{name}.weight" for b in range(BLOCKS) for name in linears}
    assert shape.sharded == split | {"tok_embeddings.weight", "output.weight"}  # the norms stay whole
    assert shape.split_share == 1.0  # every linear layer is planned
    activation, logits, norm = BATCH * SEQ * DIM * 4, BATCH * SEQ * VOCAB * 4, DIM * 4
    split = [("reduce_scatter", activation), ("all_gather", activation)]  # forward, backward: or the reverse
    expected = split  # the embedding's output, split along the sequence
    expected += (split * 4 + [("all_reduce", norm)] * 2) * BLOCKS  # wo, w2, two prepared inputs; two norms
    expected += [
        ("all_reduce", norm),
        ("all_gather", activation),
        ("all_gather", logits),
        ("reduce_scatter", activation),
    ]
    assert sorted(shape.exchanges) == sorted(expected)
    whole = tensor_parallel_shape(model, llama_tp_plan(model, sequence_parallel=False), loss_fn, batch)
    expected = [("all_reduce", activation)] * (1 + 2 * 2 * BLOCKS) + [
        ("all_gather", logits),
        ("all_reduce", activation),
    ]
    assert sorted(whole.exchanges) == sorted(expected)  # Megatron's pairs: one all-reduce each way
    # a plan of the feed-forward only splits its share of the multiply-adds
    ffn = {
        f"layers.{b}.feed_forward.{w}": llama_tp_plan(model, False)[f"layers.{b}.feed_forward.{w}"]
        for b in range(BLOCKS)
        for w in ("w1", "w2", "w3")
    }
    part = tensor_parallel_shape(model, ffn, loss_fn, batch)
    per_block = {"attention": 4 * DIM * DIM, "feed_forward": 3 * DIM * HIDDEN}
    total = BLOCKS * sum(per_block.values()) + DIM * VOCAB
    assert part.split_share == pytest.approx(BLOCKS * per_block["feed_forward"] / total)
    with pytest.raises(ConfigurationError, match="which is no module of the model"):
        tensor_parallel_shape(model, {"layers.*.mlp": ffn["layers.0.feed_forward.w1"]}, loss_fn, batch)


def profiled():
    model, optimizer, loss_fn, batch = llama()
    times = ComputeTimes(0.02, 0.04, 0.01, under_load=True)
    return profile_step(model, optimizer, loss_fn, batch, times, tp_plan=llama_tp_plan(model, sequence_parallel=True))


@pytest.mark.quick
def test_degrees_within_a_host_are_weighed_and_the_rest_left_out_with_the_reason():
    profile = profiled()
    adamw = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    one_host = rank(profile, simple_cluster(1, 4, 100, 1e4), adamw, "step_time", STEPS_FACTORS, time.perf_counter())
    labels = {c.label for c in one_host.ranked}
    assert {"fused_allreduce, dp=2×tp=2", "zero1, dp=2×tp=2", "zero3, dp=2×tp=2"} <= labels
    assert "fused_allreduce, dp=1×tp=4" in labels and "zero1, dp=1×tp=4" not in labels  # one group: one mode
    hosts = rank(profile, simple_cluster(4, 1, 100, 1e4), adamw, "step_time", STEPS_FACTORS, time.perf_counter())
    assert not any(c.layout.tp > 1 for c in hosts.ranked)
    assert any(r.label == "tp=2" and "span hosts" in r.reason for r in hosts.rejected)
    unplanned = rank(
        dataclasses.replace(profile, tensor_parallel=None),
        simple_cluster(1, 4, 100, 1e4),
        adamw,
        "step_time",
        STEPS_FACTORS,
        time.perf_counter(),
    )
    assert any(r.label == "tp=4" and "tp_plan" in r.reason for r in unplanned.rejected)
    muon_like = type("Adafactor", (torch.optim.SGD,), {})([nn.Parameter(torch.zeros(1))], lr=0.1)
    refused = rank(profile, simple_cluster(1, 4, 100, 1e4), muon_like, "step_time", STEPS_FACTORS, time.perf_counter())
    assert any(r.label == "fused_allreduce, dp=2×tp=2" and "element-wise" in r.reason for r in refused.rejected)


@pytest.mark.quick
def test_a_degree_is_priced_by_the_stated_formula():
    """docs/planner.md: a rank of a tp group runs tp example batches at (1 − s + s/tp) of the work, holds the split
    parameters' 1/tp (with their state), all-reduces its shards' gradients over the dp groups and exchanges
    activations within its group, on the host's link."""
    profile, cluster, tp = profiled(), simple_cluster(2, 2, 100, 1e4), 2
    shape, times = profile.tensor_parallel, profile.compute
    got = estimate(Layout("fused_allreduce", 2, tp=tp), profile, cluster, {})
    kept = sum(size // tp if name in shape.sharded else size for name, size in profile.parameters)
    compute = (times.forward + times.backward) * tp * (1 - shape.split_share + shape.split_share / tp)
    assert got.compute == pytest.approx(compute + times.update * kept / profile.parameter_bytes)
    host, network = cluster.host_link, cluster.network_link
    exchanges = sum(host.seconds(kind, size * tp, tp) for kind, size in shape.exchanges)
    assert got.communication == pytest.approx(exchanges + network.seconds("all_reduce", kept, 2))  # one bucket
    assert got.sent["network"] == pytest.approx(kept)  # a ring of two sends half, twice
    one_group = estimate(Layout("fused_allreduce", 1, tp=4), profile, simple_cluster(1, 4, 100, 1e4), {})
    assert one_group.peak < estimate(Layout("fused_allreduce", 4), profile, simple_cluster(1, 4, 100, 1e4), {}).peak


@pytest.mark.quick
def test_a_tensor_parallel_pick_says_how_to_run_it():
    profile = profiled()
    made = plan(
        None,
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))]),
        None,
        (),
        simple_cluster(1, 4, 100, 1e4),
        profile=profile,
    )
    pick = next(c for c in made.ranked if c.layout.tp > 1)
    model, optimizer, loss_fn, batch = llama()
    with pytest.raises(ConfigurationError, match=r"apply_tensor_parallel\(model, tp_plan\)"):
        transpile(model, optimizer, pick, loss_fn, batch)
    assert next(c for c in made.ranked if c.layout.tp == 1).apply_tensor_parallel(model, {}) is None


def test_the_cli_weighs_the_degrees_of_a_plan_it_is_given(capsys):
    """Traces a small llama and times its step (about 3 s)."""
    args = ["plan", "bench/models.py:llama_factory", "--hosts", "1", "--ranks-per-host", "4", "--mbit", "100"]
    assert main([*args, "--memory-mib", "4096", "--tp-plan", "bench/models.py:llama_sequence_parallel_plan"]) == 0
    out = capsys.readouterr().out
    assert "zero2, dp=2×tp=2" in out and "fused_allreduce, dp=1×tp=4" in out
    assert main([*args, "--memory-mib", "4096"]) == 0
    assert "tp=2: give plan(..., tp_plan=)" in capsys.readouterr().out


def tensor_parallel_pick() -> dict:
    """In a world of two (tests/test_planner.py's): the plan's pick of tp=2 applied, three steps, and the
    collectives on tp its program issues against those the planner counted."""
    model, optimizer, loss_fn, batch = llama()
    tp_plan = llama_tp_plan(model, sequence_parallel=True)
    made = plan(model, optimizer, loss_fn, batch, simple_cluster(1, 2, 100, 1e4), tp_plan=tp_plan)
    pick = next(c for c in made.ranked if c.layout.tp == 2)
    mesh = pick.apply_tensor_parallel(model, tp_plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = transpile(model, optimizer, pick, loss_fn, batch, mesh=mesh)
    losses = [float(step(*batch)) for _ in range(3)]
    issued = Counter(
        next(kind for kind in ("all_reduce", "all_gather", "reduce_scatter") if c.op.startswith(kind))
        for program in step.programs.values()
        for c in collective_sequence(program.graph)
        if c.group == "tp"
    )
    counted = Counter(kind for kind, _ in made.profile.tensor_parallel.exchanges)
    return {
        "label": pick.label,
        "losses": losses,
        "wq": tuple(model.layers[0].attention.wq.weight.shape),
        "issued": dict(issued),
        "counted": dict(counted),
    }
