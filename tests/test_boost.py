"""The Boost and SINGA strategies on real processes (gloo over loopback, world size 2), one world for all.

Where parity is bitwise, and why (world size 2):
* accumulation against DDP with ``no_sync`` and ``loss / k``: seeds of 1/2 and
  1/k (powers of two) scale every backward value exactly, and a sum of two
  values does not depend on gloo's order;
* clipping against DDP + ``clip_grad_norm_``: the graph runs the ops
  ``clip_grad_norm_`` runs on CPU (``_foreach_norm``, stack, norm, reciprocal,
  clamp, mul) on the same reduced gradients, in model order;
* loss scaling without overflow against the unscaled run: a power-of-two scale
  and its reciprocal are exact;
* sparsification against the published rule computed eagerly here; ratio 1
  against the dense all-reduce (0 + a + b == a + b);
* all-gather mode against the optimizer stepped once per rank's gradient;
* partial sync against a local step followed by SINGA's all-reduce / W;
* ``allreduce`` and ``fused_allreduce`` with accumulation, dynamic loss scaling, clipping and freeze together
  against the same rules written eagerly (all-reduce / W, GradScaler, clip_grad_norm_, the freeze cycle).
Accumulation with AdaSum and LocalSGD: against numpy's AdaSum tree plus SGD, and the mean of every rank's
eager local update (float32 rounding of a float64 reference, and a mean summed in another order).
Tolerances: against single-process training on the concatenated batch (mean
of means rounds differently: 1e-6 abs); compression (format-derived bound, in
the test); loss scaling with fp16 compression (the scale changes which fp16
roundings happen: 1e-5 abs over 5 steps).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tests.helpers import adasum_tree
from tests.worlds import run_in_world
from transpiler.strategies.schedules import continuous_freeze_cycle

ATOL = 1e-6
LR = 0.05


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_in_world(2, "tests.boost_worker:checks", tmp_path_factory.mktemp("boost"), timeout=280)


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def assert_all_close(ours: list, reference: list, atol: float = ATOL) -> None:
    for t, (a, b) in enumerate(zip(ours, reference, strict=True)):
        for name in a:
            assert (a[name] - b[name]).abs().max() <= atol, f"step {t + 1} {name}"


def test_accumulation_matches_ddp_no_sync_bitwise_and_the_concatenated_batch(ranks):
    for rank in ranks:
        record = rank["accumulation"]
        assert all(same(a, b) for a, b in zip(record["ours"], record["ddp"], strict=True))
        assert_all_close(record["ours"][1::2], record["single"][1::2])
        assert record["variants"] == ["accumulate", "step"] * 3
        # exactly one reduction per cycle: nothing in the micro-step, one bucket in the update
        assert record["plans"] == {"accumulate": [], "step": record["plans"]["step"]} and record["plans"]["step"]


def test_accumulation_with_adasum_follows_the_published_adasum(ranks):
    """Each cycle: numpy's AdaSum tree (tests/helpers.py) of every rank's accumulated gradient (an eager twin's,
    each micro-step's loss /2), then SGD with momentum 0.9, in float64 from the step's own parameters and momentum
    before the cycle. Within float32 rounding of that (the graph sums in float32 and in another order); the
    ranks agree bit for bit."""
    cycles = ranks[0]["accumulation_composed"]["adasum"]
    assert len(cycles) == 4
    for t, cycle in enumerate(cycles):
        assert cycle["variant"] == "step", cycle["variant"]
        for name, before in cycle["before"].items():
            grads = cycle["grads"][name].double().numpy()
            assert not np.allclose(grads[0], grads[-1]), "the ranks must see different data"
            combined = torch.from_numpy(adasum_tree([[g] for g in grads])[0].reshape(tuple(before.shape)))
            buffer = combined if t == 0 else 0.9 * cycle["momentum"][name].double() + combined
            expected = before.double() - LR * buffer
            torch.testing.assert_close(cycle["after"][name].double(), expected, atol=1e-6, rtol=1e-5)
            for other in ranks[1:]:
                assert torch.equal(other["accumulation_composed"]["adasum"][t]["after"][name], cycle["after"][name])


def test_accumulation_with_local_sgd_averages_what_each_rank_trained(ranks):
    """Each cycle an eager twin takes this rank's local update (2 micro-steps, loss /2, SGD with momentum); on a
    sync every rank holds the mean of all ranks' (within float32 rounding: the mean is summed in another order),
    on a local update its own, bit for bit."""
    variants = []
    for rank, results in enumerate(ranks):
        for t, cycle in enumerate(results["accumulation_composed"]["local_sgd"]):
            variants.append(cycle["variant"])
            for name, after in cycle["after"].items():
                pre = cycle["pre"][name]
                if cycle["variant"] == "sync":
                    mean = pre.double().mean(0).float()
                    torch.testing.assert_close(after, mean, atol=1e-6, rtol=1e-5, msg=f"cycle {t + 1} {name}")
                else:
                    assert torch.equal(after, pre[rank]), f"rank {rank} cycle {t + 1} {name}"
    assert {"sync", "local"} <= set(variants), variants


def test_an_inf_on_one_rank_makes_every_rank_skip_and_back_off(ranks):
    records = [rank["loss_scaling"]["inject"] for rank in ranks]
    assert records[0] == records[1]  # the same decisions and scales on every rank
    overflow = [m["overflow"] for m, *_ in records[0]]
    assert overflow == [0, 0, 1, 0, 0, 0, 0, 0]
    _, unchanged, kept, scale = records[0][2]
    assert unchanged and kept and scale == 512.0  # parameters and momentum untouched, the scale halved
    assert not any(u for _, u, _, _ in records[0][:2] + records[0][3:])
    # growth_interval=3: three clean steps after the overflow (calls 4, 5, 6), then the scale doubles
    assert [s for *_, s in records[0]] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0, 1024.0]
    assert ranks[0]["loss_scaling"]["inject_state"] == ["loss_scale.growth_tracker", "loss_scale.scale"]


def test_dynamic_loss_scaling_is_ddp_with_torchs_grad_scaler(ranks):
    """The independent reference: DDP with ``torch.amp.GradScaler`` (init_scale 1024, growth_interval 3) on the
    same batches and the same inf. The same scale after every step, the same skipped step, and the same
    parameters bit for bit (scales are powers of two, so scaling and unscaling are exact)."""
    for rank in ranks:
        ours = rank["loss_scaling"]["inject"]
        reference = rank["loss_scaling"]["grad_scaler"]
        assert [s for *_, s in ours] == [s for s, _ in reference]
        params = rank["loss_scaling"]["inject_params"]
        assert all(same(a, b) for a, (_, b) in zip(params, reference, strict=True))


@pytest.mark.parametrize("combination", ["clean", "adasum", "accumulation"])
def test_loss_scaling_without_overflow_is_bitwise_the_unscaled_run(ranks, combination):
    for rank in ranks:
        ours, reference = rank["loss_scaling"][combination]
        assert all(same(a, b) for a, b in zip(ours, reference, strict=True))


def test_loss_scaling_with_compression(ranks):
    ours, reference = ranks[0]["loss_scaling"]["compress"]
    assert_all_close(ours, reference, atol=1e-5)


def test_clipping_matches_ddp_with_clip_grad_norm_(ranks):
    for rank in ranks:
        record = rank["clipping"]
        assert all(same(a, b) for a, b in zip(record["ours"], record["ddp"], strict=True))
        assert record["norms"] == record["ddp_norms"]  # the norm the user reads, equal on every rank
        assert_all_close(record["ours"], record["single"])
        ours, reference = record["combined"]  # with loss scaling and accumulation
        assert all(same(a, b) for a, b in zip(ours, reference, strict=True))
    assert ranks[0]["clipping"]["norms"] == ranks[1]["clipping"]["norms"]


@pytest.mark.parametrize("wire,unit", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_compressed_allreduce_within_the_formats_rounding(ranks, wire, unit):
    """One step: each share is rounded once to the wire format, their sum once more, so the reduced
    gradient is off by at most ``2u(|a|+|b|)`` (plus fp16's subnormal spacing 2^-24 per rounding);
    the parameter update adds an fp32 rounding of ``p``."""
    record = ranks[0]["compression"]
    before = ranks[0]["compression"]["plain"][0]
    for name, shares in record["shares"].items():
        ours, plain = record[wire][0][name], before[name]
        bound = LR * (2 * unit * shares.abs().sum(0) + 2 * 2.0**-24) + 2 * 2.0**-24 * plain.abs()
        assert bool(((ours - plain).abs() <= bound).all()), f"{wire} {name}"
    for entry in record[f"{wire}_plan"]:
        assert entry["compressed"] == {"fp16": "float16", "bf16": "bfloat16"}[wire]
    assert_all_close(record[wire], record["plain"], atol=1e-3)  # drift over 5 steps stays small
    ours, reference = record["local"]
    assert_all_close(ours, reference, atol=1e-4)


def interval_rule(groups: int, freeze_p: float, seed: int, steps: int) -> list[int]:
    """MindSpore's interval schedule, from its published rule (not from the implementation)."""
    out, zeros, frozen = [0], 1, 0
    for t in range(1, steps):
        if frozen / (zeros + frozen) < 1 - freeze_p:
            weights = [groups - i for i in range(groups - 1, 0, -1)]  # index n-1 weight 1 ... index 1 weight n-1
            out.append(random.Random(f"freeze:{seed}:{t}").choices(range(groups - 1, 0, -1), weights=weights)[0])
            frozen += 1
        else:
            out.append(0)
            zeros += 1
    return out


def test_freeze_follows_the_published_schedules_and_freezes_exactly(ranks):
    record = ranks[0]["freeze"]
    indices = {k: [int(v.rpartition("freeze")[2]) for v, *_ in rec] for k, rec in record.items()}
    assert indices["continuous"] == (continuous_freeze_cycle(3, 0.5) * 3)[:10] == [0, 0, 1, 2, 0, 0, 1, 2, 0, 0]
    assert indices["interval"] == interval_rule(3, 0.4, 7, 10)
    assert set(indices["interval"]) == {0, 1, 2}
    # with accumulation the index holds for a whole cycle and follows the same rule per update
    assert indices["accumulate"][1::2] == interval_rule(3, 0.4, 7, 5)
    assert indices["accumulate"][::2] == indices["accumulate"][1::2]
    for name, rec in record.items():
        for variant, changed, kept, _ in rec:
            index = int(variant.rpartition("freeze")[2])
            if variant.startswith("accumulate"):
                assert not any(changed)
                continue
            assert changed == [i >= 2 * index for i in range(6)], (name, variant)  # 6 tensors, 2 per group
            assert all(kept[: 2 * index]), (name, variant)  # frozen momentum untouched
        for mine, other in zip(rec, ranks[1]["freeze"][name]):
            assert mine[0] == other[0] and same(mine[3], other[3])  # ranks agree, bitwise


def test_sparsification_is_the_published_rule_with_error_feedback(ranks):
    for rank in ranks:
        record = rank["sparsification"]
        n = record["sizes"][0]
        assert record["topk"] == [math.ceil(0.3 * n)]
        for entry in record["record"]:
            assert entry["exact"] and entry["k"] == math.ceil(0.3 * n)
            assert entry["residual_equal"]  # the residual is x - sent, bitwise
            assert same(entry["params"], entry["reference"])
        assert all(f"residual.{name}" in record["in_state_dict"] for name in record["record"][0]["params"])
        ones, dense = record["ratio_one"]
        assert all(same(a, b) for a, b in zip(ones, dense, strict=True))
    sent = ranks[0]["sparsification"]["bytes"]
    assert sent == math.ceil(0.3 * 1893) * (4 + 4) < 1893 * 4  # int32 indices and values, against the dense bucket


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_allgather_applies_the_optimizer_once_per_rank_gradient(ranks, optimizer):
    for rank in ranks:
        ours, reference = rank["allgather"][optimizer]
        assert all(same(a, b) for a, b in zip(ours, reference, strict=True))


def test_partial_sync_averages_each_partition_once_per_cycle(ranks):
    record = ranks[0]["partial_sync"]
    members = record["members"]
    averaged = sorted(n for names in members.values() for n in names)
    assert averaged == sorted(record["names"])  # every parameter in exactly one partition
    variants = [v for v, _, _ in record["record"]]
    assert variants == ["sync0", "sync1", "sync2"] * 2
    assert variants == [v for v, _, _ in ranks[1]["partial_sync"]["record"]]
    for rank in ranks:
        for _, ours, reference in rank["partial_sync"]["record"]:
            assert same(ours, reference)


def test_allreduce_mode_takes_the_same_wrapping_options(ranks):
    """``allreduce`` and ``fused_allreduce`` with accumulation, dynamic loss scaling, clipping and freeze together
    are, after every update, bitwise the eager reference written from each rule (DDP's sum / W,
    torch.amp.GradScaler, clip_grad_norm_, Boost's continuous freeze cycle)."""
    for rank in ranks:
        record = rank["allreduce_wrappers"]
        assert len(record["reference"]) == 4
        for mode in ("ours", "fused"):
            for t, (a, b) in enumerate(zip(record[mode], record["reference"], strict=True)):
                assert same(a, b), f"{mode} update {t + 1}: {max((a[n] - b[n]).abs().max().item() for n in a)}"
        assert record["variants"][1::2] == ["step/freeze0", "step/freeze1"] * 2, record["variants"]
        assert record["variants"][::2] == ["accumulate/freeze0", "accumulate/freeze1"] * 2, record["variants"]


def test_compiled_programs_match_the_uncompiled_ones_and_agree_across_ranks(ranks):
    """compile=True (torch.compile, Inductor, collectives kept in the graph) at world size 2: within 1e-6 of
    the uncompiled program over 4 steps (Inductor fuses and reorders float arithmetic; measured 3e-8), and the
    ranks agree bitwise wherever they synchronise (every step; LocalSGD with k=2 every other step)."""
    for mode in ("fused_allreduce", "local_sgd", "adasum"):
        for rank in ranks:
            record = rank["compiled"][mode]
            assert_all_close(record["compiled"], record["plain"])
            assert record["seconds"], "the first call compiled"
        first, second = (rank["compiled"][mode]["compiled"] for rank in ranks)
        variants = ranks[0]["compiled"][mode]["variants"]
        synced = [t for t, v in enumerate(variants) if v != "local"]
        assert len(synced) == (2 if mode == "local_sgd" else 4), variants
        assert all(same(first[t], second[t]) for t in synced), mode
