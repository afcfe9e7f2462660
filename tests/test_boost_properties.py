"""Invariants of the Boost and SINGA passes and schedules, checked with hypothesis."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from passes.partitions import group_bounds, partition_of
from tests.helpers import assert_rewrite_is_final, strategy_of
from transpiler import (
    Accumulation,
    Clipping,
    Compression,
    DataParallel,
    Freeze,
    LossScaling,
    Sparsification,
    transpile,
)
from transpiler.build import rewrite
from transpiler.graph.collectives import is_collective
from transpiler.runtime.process_group import Placement
from transpiler.strategies.schedules import EveryStep, FreezeSchedule, continuous_freeze_cycle
from transpiler.trace.tracer import trace_step

SLOW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
widths_strategy = st.lists(st.integers(1, 12), min_size=2, max_size=4)


def mlp(widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


@pytest.mark.quick
@given(count=st.integers(1, 60), groups=st.integers(1, 60))
def test_freeze_groups_are_consecutive_near_equal_and_cover(count, groups):
    assume(groups <= count)
    bounds = group_bounds(count, groups)
    assert bounds[0] == 0 and bounds[-1] == count
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert all(s >= 1 for s in sizes) and max(sizes) - min(sizes) <= 1


@pytest.mark.quick
@given(sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40), partitions=st.integers(1, 8))
def test_partial_sync_partitions_are_consecutive_and_in_range(sizes, partitions):
    owner = partition_of(sizes, partitions)
    assert owner[0] == 0 and all(b - a in (0, 1) for a, b in zip(owner, owner[1:]))  # consecutive, in order
    assert all(0 <= o < partitions for o in owner)
    if len(sizes) >= partitions:
        assert set(owner) == set(range(partitions))  # none empty


@given(groups=st.integers(2, 10), p=st.floats(0.0, 0.95))
def test_continuous_cycle_has_the_published_share_of_zeros(groups, p):
    """Boost's continuous freeze: a share p of the cycle's steps train everything (index 0), then each frozen group
    once. The share lands as close to p as whole steps allow: within half a step of the cycle."""
    cycle = continuous_freeze_cycle(groups, p)
    zeros = cycle.count(0)
    assert abs(zeros / len(cycle) - p) <= 0.5 / len(cycle) + 1e-12
    assert cycle[zeros:] == list(range(1, groups))


def interval_indices(groups: int, p: float, seed: int, steps: int) -> list[int]:
    schedule = FreezeSchedule(EveryStep(), groups, 1, p, seed)
    out = []
    for _ in range(steps):
        variant = schedule.variant()
        out.append(int(variant.rpartition("freeze")[2]))
        schedule.observe(variant, {}, 0.1)
    return out


@given(groups=st.integers(2, 8), p=st.floats(0.05, 0.95), seed=st.integers(0, 1000))
def test_interval_schedule_keeps_the_share_of_unfrozen_steps_at_freeze_p(groups, p, seed):
    steps = 200
    indices = interval_indices(groups, p, seed, steps)
    assert indices[0] == 0 and all(0 <= i < groups for i in indices)
    # a frozen index is drawn while the frozen share is below 1 - p, so the share of zeros tracks p
    assert abs(indices.count(0) / steps - p) <= 2 / steps
    assert indices == interval_indices(groups, p, seed, steps)  # same seed, same sequence on every rank


@SLOW
@given(widths=widths_strategy, ratio=st.floats(0.01, 1.0), seed=st.integers(0, 50))
def test_topk_sends_exactly_the_largest_entries_and_keeps_the_rest(widths, ratio, seed):
    model = mlp(widths, seed)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, widths[0]), torch.randn(5, widths[-1])
    config = DataParallel(bucket_cap_mb=1e-9, sparsification=Sparsification(ratio=ratio))
    step = transpile(model, opt, config, nn.MSELoss(), (x, y))
    step(x, y)
    nn.MSELoss()(twin(x), y).backward()
    sent_only = copy.deepcopy(twin)  # eager SGD on the entries that went out, the rest zero
    for (name, p), q in zip(twin.named_parameters(), sent_only.parameters(), strict=True):  # a bucket each
        g = p.grad.reshape(-1)
        left = step.extra[f"residual.{name}"].reshape(-1)
        chosen = left == 0
        k = max(1, math.ceil(ratio * g.numel()))
        assert torch.equal(left[~chosen], g[~chosen])  # the residual keeps exactly what was not sent
        assert int(chosen.sum()) >= k  # at least k entries went out (an entry of g that is 0 counts too)
        if not chosen.all():
            assert g[chosen].abs().min() >= g[~chosen].abs().max()  # never a smaller |x| sent over a larger kept
        q.grad = torch.where(chosen, g, torch.zeros_like(g)).view_as(q)
    torch.optim.SGD(sent_only.parameters(), lr=0.1).step()
    for a, b in zip(model.parameters(), sent_only.parameters(), strict=True):  # what was sent is what trained
        assert torch.equal(a, b)


@SLOW
@given(widths=widths_strategy, k=st.integers(1, 4), seed=st.integers(0, 50))
def test_accumulation_is_eager_micro_batch_accumulation_bitwise(widths, k, seed):
    model = mlp(widths, seed)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    config = DataParallel(accumulation=Accumulation(steps=k) if k > 1 else None)
    step = transpile(model, opt, config, nn.MSELoss())
    for i in range(2 * k):
        x, y = torch.randn(3, widths[0]), torch.randn(3, widths[-1])
        step(x, y)
        (nn.MSELoss()(twin(x), y) / k).backward()
        if i % k == k - 1:
            twin_opt.step()
            twin_opt.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


COMBINATIONS = st.fixed_dictionaries(
    {
        "accumulation": st.sampled_from([None, Accumulation(steps=2), Accumulation(steps=3)]),
        "loss_scaling": st.sampled_from([None, LossScaling(), LossScaling(dynamic=False, init_scale=8.0)]),
        "clipping": st.sampled_from([None, Clipping(max_norm=1.0)]),
        "freeze": st.sampled_from([None, Freeze(groups=2)]),
        "compression": st.sampled_from([None, Compression()]),
    }
)


def rewritten_variants(widths, mode, options, world, make_opt=torch.optim.SGD):
    """Every variant of the strategy, rewritten for rank 0 (verifiers and cross-rank check on), after checking
    that running its passes again changes nothing and that its all-gathers run alone."""
    model = mlp([max(w, 2) for w in widths])
    batch = (torch.randn(4, max(widths[0], 2)), torch.randn(4, max(widths[-1], 2)))
    traced = trace_step(model, make_opt(model.parameters(), lr=0.1), nn.MSELoss(), batch)[0].program
    programs = {}
    for variant, passes in strategy_of(mode, **options).variants.items():
        program = rewrite(traced, passes, Placement(world, 0, "world", False))
        assert_rewrite_is_final(program, passes, f"{variant}: ")
        assert_all_gathers_run_alone(program.graph)
        programs[variant] = program
    return programs


def assert_all_gathers_run_alone(graph) -> None:
    """On the CPU every all-gather is issued with no other collective in flight and waited at once (torch's
    gloo corrupts the heap otherwise: docs/strategies/zero.md)."""
    c10d = torch.ops._c10d_functional
    in_flight: set = set()
    for node in graph.nodes:
        if node.target is c10d.wait_tensor.default:
            in_flight.discard(node.args[0])
        elif node.target is c10d.all_gather_into_tensor.default:
            assert not in_flight, f"{node.name} is issued while {sorted(n.name for n in in_flight)} are in flight"
            assert node.next.target is c10d.wait_tensor.default and node.next.args[0] is node, node.name
        elif node.op == "call_function" and node.target in (
            c10d.all_reduce.default,
            c10d.reduce_scatter_tensor.default,
            c10d.broadcast.default,
        ):
            in_flight.add(node)


@pytest.mark.quick
@SLOW
@given(
    widths=widths_strategy,
    options=COMBINATIONS,
    world=st.integers(1, 4),
    mode=st.sampled_from(["allreduce", "fused_allreduce"]),
)
def test_every_composition_verifies_on_every_rank_and_is_idempotent(widths, options, world, mode):
    """Each variant passes the verifiers (roles, waits, one reduction per gradient) and the cross-rank check;
    running its passes again changes nothing."""
    if mode == "allreduce":
        options = {k: v for k, v in options.items() if k != "compression"}
    programs = rewritten_variants(widths, mode, options, world)
    assert programs.keys() == strategy_of(mode, **options).variants.keys()
    for variant, program in programs.items():  # at W > 1 every variant but a micro-step communicates
        if world > 1:
            communicates = any(is_collective(n) for n in program.graph.nodes)
            assert communicates == (not variant.startswith("accumulate")), (variant, world)


@pytest.mark.quick
@SLOW
@given(
    widths=widths_strategy,
    options=COMBINATIONS,
    world=st.integers(1, 4),
    mode=st.sampled_from(["zero1", "zero2", "zero3"]),
    adam=st.booleans(),
    reshard=st.booleans(),
)
def test_sharded_compositions_verify_tile_and_are_idempotent(widths, options, world, mode, adam, reshard):
    """zero1/zero2/zero3 with accumulation, loss scaling and clipping (zero3 with or without
    ``reshard_after_forward``): each variant verifies, its programs for every rank agree and tile the
    parameters (checked inside ``rewrite``), and a second run changes nothing. zero1/zero2 gather once per
    bucket; zero3 once for the forward and, resharding, again for the backward where it reads the bucket."""
    options = {k: v for k, v in options.items() if k not in ("freeze", "compression")}
    if mode == "zero3":
        options["reshard_after_forward"] = reshard
    make = torch.optim.Adam if adam else torch.optim.SGD
    for variant, program in rewritten_variants(widths, mode, options, world, make).items():
        kinds = [n.meta["collective"]["kind"] for n in program.graph.nodes if "collective" in n.meta]
        scatters, gathers = kinds.count("reduce_scatter"), kinds.count("all_gather")
        if world > 1 and variant == "step" and mode != "zero3":
            assert scatters == gathers > 0, kinds
        elif world > 1 and variant == "step":
            assert scatters <= gathers <= (2 if reshard else 1) * scatters and scatters > 0, kinds


@pytest.mark.quick
@SLOW
@given(
    widths=widths_strategy,
    world=st.integers(1, 4),
    mode=st.sampled_from(["allgather", "partial_sync"]),
    adam=st.booleans(),
)
def test_allgather_and_partial_sync_verify_agree_across_ranks_and_are_idempotent(widths, world, mode, adam):
    """Every rank issues the same collectives (the cross-rank check inside ``rewrite``); a second run of the
    passes changes nothing; all-gather copies the update once per other rank."""
    options = {"partitions": 1} if mode == "partial_sync" else {}
    make = torch.optim.Adam if adam else torch.optim.SGD
    for program in rewritten_variants(widths, mode, options, world, make).values():
        if mode == "allgather":
            copies = {n.meta.get("copy", 0) for n in program.graph.nodes if n.meta.get("role") == "optimizer"}
            assert copies == set(range(world))
