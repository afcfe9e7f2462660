"""Checkpointer and DataPosition in one process: periodic atomic checkpoints, keeping the last K, a bitwise
resume, and a data position that survives a change of world size with no sample skipped or repeated.
The same in real worlds, over hosts and restarts: tests/test_multihost.py."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.tiny_models import MLP, make_batch
from transpiler import (
    Accumulation,
    Checkpointer,
    CheckpointError,
    ConfigurationError,
    DataPosition,
    ZeRO,
    transpile,
)

pytestmark = pytest.mark.quick  # the quick tier: the data position and the Checkpointer in one process, 3 s

LOSS = torch.nn.CrossEntropyLoss()


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 200),
    batch_per_rank=st.integers(1, 8),
    segments=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6]), st.integers(0, 30), st.integers(0, 5)), max_size=6),
    seed=st.integers(0, 9),
)
def test_restarts_at_other_world_sizes_see_every_sample_once_per_epoch(size, batch_per_rank, segments, seed):
    """A run that is cut short again and again: each segment runs at its own world size for some steps, and
    its last few steps are lost (the job died after its last checkpoint); the next segment resumes from that
    checkpoint's position. The steps that count (those before each checkpoint) hand out, per epoch, every
    sample at most once and, in every finished epoch, each of the first ``steps_per_epoch * global_batch`` of
    the epoch's permutation exactly once (the last partial global batch is dropped)."""
    global_batch = batch_per_rank * 12  # divisible by every world size drawn
    if global_batch > size:
        with pytest.raises(ConfigurationError, match="global_batch"):
            DataPosition(size, global_batch, seed)
        return
    saved = DataPosition(size, global_batch, seed).state_dict()
    seen: dict[int, list[int]] = {}
    for world, steps, lost in segments:
        position = DataPosition(size, global_batch, seed)
        position.load_state_dict(saved)
        iterators = [None] * world
        for done in range(steps + lost):
            if iterators[0] is None:
                epoch = position.epoch
                copies = [copy.deepcopy(position) for _ in range(world)]  # every rank holds its own position
                iterators = [c.epoch_batches(r, world) for r, c in enumerate(copies)]
            shards = [next(it, None) for it in iterators]
            if shards[0] is None:  # the epoch is over on every rank at once
                position, iterators = copies[0], [None] * world
                assert all(c.state_dict() == position.state_dict() for c in copies)
                continue
            assert all(len(s) == global_batch // world for s in shards)
            if done < steps:
                seen.setdefault(epoch, []).extend(torch.cat(shards).tolist())
                saved = copies[0].state_dict()  # a checkpoint after this step
    for epoch, ids in seen.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample seen twice"
        order = DataPosition(size, global_batch, seed).order(epoch).tolist()
        assert ids == order[: len(ids)], f"epoch {epoch}: not the epoch's permutation in order"


def test_the_order_is_one_generator_drawing_a_permutation_per_epoch():
    """The example's loop before DataPosition drew one randperm per epoch from one generator: the same order."""
    generator = torch.Generator().manual_seed(3)
    drawn = [torch.randperm(50, generator=generator) for _ in range(4)]
    position = DataPosition(50, 10, seed=3)
    assert all(torch.equal(position.order(e), drawn[e]) for e in range(4))


def test_a_position_saved_with_other_settings_is_refused():
    saved = DataPosition(100, 10, seed=1).state_dict()
    for other in (DataPosition(100, 20, seed=1), DataPosition(100, 10, seed=2), DataPosition(99, 10, seed=1)):
        with pytest.raises(CheckpointError, match="skip or repeat"):
            other.load_state_dict(saved)
    with pytest.raises(ConfigurationError, match="divisible"):
        next(DataPosition(100, 10).epoch_batches(0, 3))


def _run(directory, steps: int, every: int = 2, keep: int = 2, resume: bool = False, accumulate: int = 1):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ZeRO(stage=2, accumulation=Accumulation(steps=accumulate) if accumulate > 1 else None)
    step = transpile(model, optimizer, config, loss_fn=LOSS)
    x, y = make_batch("mlp", 64, torch.Generator().manual_seed(5))
    position = DataPosition(64, 8, seed=1)
    checkpointer = Checkpointer(step, directory, every=every, keep=keep, position=position)
    resumed = checkpointer.resume() if resume else None
    saved = []
    while checkpointer.steps < steps:
        for idx in position.epoch_batches(0, 1):
            step(x[idx], y[idx])
            if (written := checkpointer.step_done()) is not None:
                saved.append(written.name)
            if checkpointer.steps == steps:
                break
    return model, position, checkpointer, saved, resumed


def test_checkpoints_every_n_steps_keep_the_last_k_and_resume_bitwise(tmp_path):
    """Every 2 steps over 11 steps (an epoch is 8): the last 2 kept. A resume from the newest (step 10) runs step
    11 to the uninterrupted run's bits, at the same data position. A folder left half-written by a killed save
    (no rename) is never read."""
    model, position, checkpointer, saved, _ = _run(tmp_path, 11)
    assert saved == [f"step-{n:08d}" for n in (2, 4, 6, 8, 10)]
    assert [p.name for p in checkpointer.complete()] == ["step-00000008", "step-00000010"]
    (tmp_path / ".partial-00000012").mkdir()  # a save killed before its rename
    (tmp_path / ".partial-00000012" / "__0_0.distcp").write_bytes(b"torn")
    resumed_model, resumed_position, resumed_checkpointer, _, resumed = _run(tmp_path, 11, resume=True)
    assert resumed is not None and resumed.name == "step-00000010"
    assert resumed_checkpointer.steps == 11
    assert resumed_position.state_dict() == position.state_dict() == {**position.state_dict(), "epoch": 1, "offset": 24}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True))


def test_a_save_due_inside_an_accumulation_cycle_waits_for_its_end(tmp_path):
    _, _, _, saved, _ = _run(tmp_path, 7, every=3, accumulate=2)
    assert saved == ["step-00000004", "step-00000006"]  # due at 3 and 6; 3 ends no cycle


def test_bad_settings_say_what_to_do(tmp_path):
    model = MLP()
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "fused_allreduce", loss_fn=LOSS)
    with pytest.raises(ConfigurationError, match="every"):
        Checkpointer(step, tmp_path, every=0)
    with pytest.raises(ConfigurationError, match="keep"):
        Checkpointer(step, tmp_path, every=1, keep=0)
    assert Checkpointer(step, tmp_path / "empty", every=1).resume() is None
