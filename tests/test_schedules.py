"""LocalSGD schedules, checked against the documented rule written out independently."""

from __future__ import annotations

import math

import pytest

from transpiler.strategies.schedules import LocalSGDSchedule

pytestmark = pytest.mark.quick  # the quick tier: static


def documented_syncs(k: int, begin_step: int, steps: int) -> list[int]:
    """Steps t = 1..steps that sync: t <= begin_step, or t - last_sync == k."""
    syncs, last = [], 0
    for t in range(1, steps + 1):
        if t <= begin_step or t - last == k:
            syncs.append(t)
            last = t
    return syncs


@pytest.mark.parametrize("k, begin_step", [(1, 1), (2, 1), (3, 1), (4, 0), (3, 5), (5, 2), (1, 0), (7, 3)])
def test_sync_schedule_over_20_steps(k, begin_step):
    schedule = LocalSGDSchedule(k_steps=k, begin_step=begin_step)
    seen = []
    for t in range(1, 21):
        variant = schedule.variant()
        if variant == "sync":
            seen.append(t)
        schedule.observe(variant, {}, lr=0.1)
    assert seen == documented_syncs(k, begin_step, 20)


def test_examples_spelled_out():
    assert documented_syncs(3, 1, 10) == [1, 4, 7, 10]
    assert documented_syncs(2, 4, 10) == [1, 2, 3, 4, 6, 8, 10]


def test_adaptive_k_follows_paddles_formula_on_a_scripted_loss_sequence():
    init_k, begin = 2, 1
    schedule = LocalSGDSchedule(k_steps=init_k, begin_step=begin, adaptive=True)
    losses = iter([2.0, 1.5, 0.9, 0.4, 0.1, 0.02, 0.5, 8.0, 500.0, 1e-4])
    lr = lambda t: 0.1 * (0.9**t)  # noqa: E731  a decaying learning rate
    loss_0 = lr_0 = None
    expected_k, expected_syncs, syncs = init_k, [], []
    last = 0
    for t in range(1, 41):
        variant = schedule.variant()
        should_sync = t <= begin or t - last == expected_k
        assert (variant == "sync") == should_sync, f"step {t}"
        metrics = {}
        if should_sync:
            avg = next(losses, 0.3)
            metrics = {"avg_loss": avg}
            if loss_0 is None:
                loss_0, lr_0 = avg, lr(t)
            expected_k = min(max(math.ceil(math.sqrt(lr_0 * avg / (lr(t) * loss_0) * init_k)), 1), 16)
            last = t
            expected_syncs.append((t, expected_k))
        schedule.observe(variant, metrics, lr=lr(t))
        if should_sync:
            syncs.append((t, schedule.k))
    assert syncs == expected_syncs
    assert {k for _, k in syncs} >= {1, 16}  # both clip bounds were hit by the script
