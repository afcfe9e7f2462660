"""Pipeline parallelism (``transpile(..., pipeline=PipelineParallel(...))``): stages cut from the whole traced step,
run over microbatches in GPipe's, 1F1B's, ZB-H1's and interleaved 1F1B's orders.

In worlds of 2 and 4 over gloo (tests/pipeline_worker.py), the bench's narrow GPT (4 blocks) trains 10 AdamW steps
on batches of 12 cut into 3 and 4 microbatches under each schedule, beside ``torch.distributed.pipelining``
(``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleavedZeroBubble`` at one stage per
rank, whose order is ZB-H1's; the same split, microbatches and loss) and beside one
process training the whole model with gradient accumulation over the same microbatches. All are bitwise alike,
parameters and losses, on every stage (checked on a 2-core AMD EPYC, torch 2.13): each stage runs the aten ops eager
autograd runs for the same microbatch, each gradient adds the microbatches in their order and is divided once by
their count (torch's ``scale_grads``; the accumulated reference divides the same way), and the update is AdamW's
own. The schedule changes the order of the work, not the arithmetic, so the schedules agree too. Microbatch counts
that are not powers of two make the test fail for a step that divides each microbatch's gradient by the count before
adding (tried: the last digit of the third loss moves). Interleaved 1F1B (2 ranks × 2 chunks) against torch's
``ScheduleInterleaved1F1B`` and accumulation, clipping by the whole model's norm against ``clip_grad_norm_``, and a
stage resumed from its snapshot: bitwise too; compiled stages (``compile=True``) within 1e-5 of the eager run.

Without a world: the cut's refusals (a skip connection around a split point, weights tied across stages, a split
point that is no module, a batch that does not cut into equal microbatches, too few microbatches for 1F1B, a world
of another size, settings interleaving does not take), each stage's program built statically (its own parameters
only; its sends pairing with the next stage's receives), the split without split points (balanced: the stage
programs equal those traced at the chosen points), and as properties (hypothesis) the schedules' orders (every
order runs without waiting forever, each microbatch's forward and backward once per chunk, the backwards in
microbatch order, the activations held within each schedule's bound; ZB-H1's length where the first stage's
input gradient is empty) and the balanced cut (no contiguous cut has a smaller largest stage).

Cost (2-core AMD EPYC, one process): the world of 2's parity job 17-24 s (in the quick tier and the narrow-kernel
lane), the world of 4's 25 s, dp × pp 60 s (two modes, the clipped run and their references), BatchNorm 9 s, the
mismatched settings 5 s, the static builds 30 s; the file about 180 s. Interleaved 1F1B, clipping, snapshots and
compiled stages: tests/test_pipeline_features.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bench.models import UnevenMLP
from passes.stage_balance import balance
from tests.pipeline_worker import adamw, base_model, batches, loss_fn
from tests.worlds import run_in_world
from transpiler import (
    Accumulation,
    ConfigurationError,
    DataParallel,
    LossScaling,
    PipelineParallel,
    StaticWorld,
    transpile,
)
from transpiler.graph.stage_ops import RECV, SEND
from transpiler.graph.stage_orders import SCHEDULES, check_orders, refusal, stage_order

RUNS = ("traced gpipe", "traced 1f1b", "traced zbh1", "torch 1f1b", "torch zbh1", "accumulated")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world, microbatches",
    [pytest.param(2, 3, marks=[pytest.mark.bitwise, pytest.mark.quick], id="world2"), pytest.param(4, 4, id="world4")],
)
def test_every_schedule_equals_torch_pipelining_and_accumulation_bitwise(world, microbatches, tmp_path):
    parity = run_in_world(world, "tests.pipeline_worker:parity", tmp_path, (microbatches,), timeout=400)
    last = parity[-1]["torch gpipe"]["losses"]  # torch's losses are the last stage's
    assert len(last) == 10
    for rank, runs in enumerate(parity):
        reference = runs["torch gpipe"]
        assert reference["params"], f"stage {rank} holds no parameters"
        for name in RUNS:
            run = runs[name]
            for param, value in reference["params"].items():
                assert torch.equal(run["params"][param], value), (
                    f"stage {rank}, {name}: '{param}' differs from torch's GPipe by "
                    f"{(run['params'][param] - value).abs().max().item()}"
                )
        for name in ("traced gpipe", "traced 1f1b", "traced zbh1", "accumulated"):
            assert runs[name]["losses"] == last, f"stage {rank}, {name}: losses {runs[name]['losses']} != {last}"


def without_key_bias(name: str, value: torch.Tensor) -> torch.Tensor:
    """A parameter less the keys' bias (the middle third of an attention's ``qkv.bias``): softmax does not change
    when every key moves by one vector, so that gradient is zero but for rounding, and AdamW turns rounding noise
    into steps of its learning rate's size. Compared within a tolerance, it would compare noise."""
    if not name.endswith("qkv.bias"):
        return value
    third = value.numel() // 3
    return torch.cat([value[:third], value[2 * third :]])


@pytest.mark.timeout(600)
def test_data_parallel_modes_beside_the_pipeline_equal_torch_pipelining_averaged_over_dp(tmp_path):
    """dp=2 × pp=2 (``mesh=init_device_mesh(..., ("pp", "dp"))``): ``zero1`` and ``zero2`` across ``dp`` under
    1F1B (``fused_allreduce`` and ``zero3``: tests/test_pipeline_3d.py, beside a tensor-parallel plan too), beside
    torch's pipelining whose gradients the test averages over ``dp`` as DDP does. Bitwise: every scaling is by a
    power of two but the microbatches' 1/3, and fl(x/6) = fl(x/3)/2. With clipping under ``zero2`` (each stage's
    norms from its ranks' shards, one all-reduce over ``dp``, then the stages' over ``pp``), beside the reference
    clipped by the definition of the whole model's norm: within 1e-5 relative or 1e-6 (measured: at most 1.2e-7),
    since a norm from shards sums in another order than the norm of the whole gradient (one rounding per step), but
    for the keys' bias (``without_key_bias``)."""
    ranks = run_in_world(4, "tests.pipeline_worker:beside_dp", tmp_path, (3,), timeout=400)
    reference_of = "torch 1f1b, averaged over dp"
    last_stage = [r[reference_of]["losses"] for r in ranks if r["stage"] == 1]  # by dp rank: rank = 2 * stage + dp
    for rank, runs in enumerate(ranks):
        stage = runs.pop("stage")
        clipped, clipped_reference = runs.pop("zero2 clipped"), runs.pop(f"{reference_of}, clipped")
        for param, value in clipped_reference["params"].items():
            got, value = without_key_bias(param, clipped["params"][param]), without_key_bias(param, value)
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {param}")
        differs = any(not torch.equal(clipped["params"][p], runs["zero2"]["params"][p]) for p in clipped["params"])
        assert differs, "clipping changed the run"
        reference = runs.pop(reference_of)
        for name, run in runs.items():
            for param, value in reference["params"].items():
                assert torch.equal(run["params"][param], value), (
                    f"rank {rank} (stage {stage}), {name}: '{param}' differs by "
                    f"{(run['params'][param] - value).abs().max().item()}"
                )
            assert run["losses"] == last_stage[rank % 2], f"rank {rank}, {name}: losses {run['losses']}"


@pytest.mark.timeout(300)
def test_batch_norm_statistics_go_from_one_microbatch_to_the_next_as_in_accumulation(tmp_path):
    """A ResNet with BatchNorm cut in two (a world of 2, about 10 s): each stage's parameters and running
    statistics after 5 SGD steps on 3 microbatches are bitwise those of one process accumulating them."""
    ranks = run_in_world(2, "tests.pipeline_worker:batch_norm", tmp_path, timeout=200)
    for rank, runs in enumerate(ranks):
        assert any("running_mean" in n for n in runs["traced"]), f"stage {rank} holds no BatchNorm"
        for name, value in runs["accumulated"].items():
            assert torch.equal(runs["traced"][name], value), f"stage {rank}: '{name}' differs"


@pytest.mark.timeout(300)
def test_stages_built_with_other_settings_fail_before_the_first_step_naming_the_difference(tmp_path):
    """Microbatches 2 on stage 0 and 4 on stage 1: each rank's receive would wait for the timeout; the stages'
    handshake after the build says which differs instead (a world of 2, about 5 s)."""
    ranks = run_in_world(2, "tests.pipeline_worker:mismatch", tmp_path, timeout=200)
    for rank in ranks:
        error = rank["error"]
        assert error is not None and "was built with" in error and "give every rank the same" in error, error
        assert "'microbatches': 4" in error and "'microbatches': 2" in error


def static_stage(rank: int, stages: int = 2, **settings) -> object:
    model = base_model()
    pipeline = PipelineParallel(stages=stages, **({"microbatches": 4} | settings))
    step = transpile(
        model, adamw(model.parameters()), "none", loss_fn, batches()[0], mesh=StaticWorld(size=stages, rank=rank),
        pipeline=pipeline,
    )  # fmt: skip
    return step.program


def messages(program, kind) -> list[tuple]:
    """Each send's or receive's (peer, tag, shape, dtype), in program order."""
    out = []
    for node in program.graph.nodes:
        if node.target is kind:
            peer, tag = node.args[2:4] if kind is SEND else node.args[4:6]
            value = node.args[0].meta["val"] if kind is SEND else node.meta["val"]
            out.append((peer, tag, tuple(value.shape), value.dtype))
    return out


def test_each_stage_holds_its_own_parameters_and_its_sends_meet_the_next_stages_receives():
    schedule = "1f1b"
    programs = [static_stage(rank, schedule=schedule) for rank in range(2)]
    names = [{p.name for p in program.inputs if p.kind == "param"} for program in programs]
    everything = {n for n, _ in base_model().named_parameters()}
    assert names[0] | names[1] == everything and not names[0] & names[1]
    assert "embed.weight" in names[0] and "head.weight" in names[1] and "blocks.2.qkv.weight" in names[1]
    for rank, program in enumerate(programs):
        peer = 1 - rank
        sent = [message[1:] for message in messages(program, SEND) if message[0] == peer]
        received = [message[1:] for message in messages(programs[peer], RECV) if message[0] == rank]
        assert sorted(sent, key=lambda m: m[1]) == sorted(received, key=lambda m: m[1])
        assert len(sent) == 4  # one per microbatch: activations forward, or their gradients back
    order = programs[0].decisions["split-stages"]
    assert order.endswith(" ".join(f"{k}{i}" for k, i, _ in stage_order(schedule, 2, 4, 0)))


def test_without_split_points_the_cut_balances_the_estimated_time_and_equals_that_cut_traced():
    """The first wide block alone is the first stage (equal counts would put both there), and each stage's
    program is the one traced with that split point given: the other candidates' marks leave no trace."""
    batch = (torch.randn(64, 16), torch.randn(64, 16))
    balanced = [build(UnevenMLP(), batch, rank=r) for r in range(2)]
    assert balanced[0].decisions["balanced-split"].startswith("split points ['blocks.1']: estimated ms per step")
    held = [{p.name for p in program.inputs if p.kind == "param"} for program in balanced]
    assert held[0] == {"blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.down.weight", "blocks.0.down.bias"}
    given = [build(UnevenMLP(), batch, rank=r, split_points=("blocks.1",)) for r in range(2)]
    for ours, theirs in zip(balanced, given):
        assert [str(n.target) for n in ours.graph.nodes] == [str(n.target) for n in theirs.graph.nodes]
    gpt = static_stage(0, microbatches=3).decisions["balanced-split"]  # the tests' GPT: the blocks' equal runs
    assert gpt.startswith("split points ['blocks.2']"), gpt


@settings(max_examples=60, deadline=None)
@given(
    seconds=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=7),
    stages=st.integers(2, 4),
)
def test_the_balanced_cut_has_the_least_largest_stage_time_of_all_contiguous_cuts(seconds, stages):
    """Of the cuts where every stage has work, where there is one (an empty first stage would send nothing)."""
    if stages > len(seconds):
        return
    cut = balance(tuple(seconds), tuple([0] * len(seconds)), stages)
    assert len(cut.starts) == stages - 1 and list(cut.starts) == sorted(set(cut.starts))
    assert 0 < cut.starts[0] and cut.starts[-1] < len(seconds)
    runs = [[sum(seconds[a:b]) for a, b in itertools.pairwise((0, *s, len(seconds)))]
            for s in itertools.combinations(range(1, len(seconds)), stages - 1)]  # fmt: skip
    working = [r for r in runs if min(r) > 0] or runs  # a cut where every stage works, where there is one
    assert max(cut.stage_seconds()) <= min(max(r) for r in working) + 1e-9
    assert min(cut.stage_seconds()) > 0 or working is runs


class BatchFirst(nn.Module):
    """Its block list's first block reads the batch: nothing runs before it (bench/planner.py's MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def test_no_stage_is_left_without_work_where_the_first_block_reads_the_batch():
    """At 4 stages over 4 blocks the cut used to start stage 1 at the first block: stage 0 ran nothing, had nothing
    to send, and the live handshake failed (RankMismatchError: stage 0 sends stage 1 [])."""
    torch.manual_seed(0)
    model = BatchFirst()
    batch = (torch.randn(8, 8), torch.randint(0, 4, (8,)))
    for rank in (0, 1):
        program = transpile(
            model, adamw(model.parameters()), "none", nn.CrossEntropyLoss(), batch, mesh=StaticWorld(size=4, rank=rank),
            pipeline=PipelineParallel(stages=4, microbatches=4),
        ).program  # fmt: skip
        assert program.decisions["balanced-split"].startswith("split points ['layers.1', 'layers.2', 'layers.3']")
        assert messages(program, SEND if rank == 0 else RECV)  # stage 0 sends its activations; stage 1 takes them


class SkipAcross(nn.Module):
    """The input of the second linear is not all the rest reads: the residual carries the first one's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.relu(h)) + h


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mid = nn.Embedding(8, 4), nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mid(self.embed(tokens)) @ self.embed.weight.t()


def build(
    model: nn.Module, batch: tuple, loss=nn.functional.mse_loss, stages: int = 2, rank: int = 0, **settings
) -> object:
    pipeline = PipelineParallel(stages=stages, **({"microbatches": 2} | settings))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = transpile(model, optimizer, "none", loss, batch, mesh=StaticWorld(size=stages, rank=rank), pipeline=pipeline)
    return step.program


def test_a_split_point_that_does_not_cut_the_step_is_refused_naming_the_op():
    batch = (torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(
        ConfigurationError, match=r"do not cut the step: backward op add_1 .* reads values of stages \[0, 1\]"
    ):
        build(SkipAcross(), batch, split_points=("b",))


def test_weights_tied_across_stages_are_refused_naming_the_parameter():
    batch = (torch.randint(0, 8, (4, 3)), torch.randn(4, 3, 8))
    with pytest.raises(ConfigurationError, match=r"parameter 'embed.weight' is read by stages \[0, 1\]"):
        build(Tied(), batch, split_points=("mid",))


@pytest.mark.parametrize(
    "settings, batch_size, match",
    [
        ({"split_points": ("nope",)}, 8, r"split point\(s\) \['nope'\] are not modules of the model"),
        ({"split_points": ("blocks.2", "blocks.4")}, 8, r"2 stages need 1 split points"),
        ({}, 6, r"4 equal microbatches along dim 0; the batch's shapes are \[\[6, 16\], \[96\]\]"),
        ({"microbatches": 1, "schedule": "1f1b"}, 8, r"'1f1b' needs at least as many microbatches as stages"),
        ({"schedule": "interleaved_1f1b"}, 8, r"runs several chunks per rank: set virtual_stages=2 or more"),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 3}, 6, r"a multiple of 2; got 3"),
        ({"virtual_stages": 2}, 8, r"virtual_stages=2 \(chunks per rank\) runs under schedule 'interleaved_1f1b'"),
        (
            {"schedule": "interleaved_1f1b", "virtual_stages": 2, "split_points": ("blocks.4",)},
            8,
            r"2 stages of 2 chunks need 3 split points",
        ),
    ],
    ids=["unknown module", "count", "batch", "1f1b", "one chunk", "groups", "virtual", "chunk count"],
)
def test_settings_that_cannot_run_are_refused(settings, batch_size, match):
    model = base_model()
    tokens, targets = batches()[0]
    batch = (tokens[:batch_size], targets[: batch_size * 16])
    with pytest.raises(ConfigurationError, match=match):
        pipeline = PipelineParallel(stages=2, **({"microbatches": 4} | settings))
        transpile(model, adamw(model.parameters()), "none", loss_fn, batch, mesh=StaticWorld(size=2), pipeline=pipeline)


@pytest.mark.parametrize(
    "config, match",
    [
        ("adasum", r"mode 'adasum' is not built beside a pipeline yet; these are: none, fused_allreduce"),
        (DataParallel(accumulation=Accumulation(steps=2)), r"accumulation beside a pipeline is not built yet"),
        (DataParallel(loss_scaling=LossScaling()), r"loss_scaling beside a pipeline is not built yet"),
    ],
    ids=["adasum", "accumulation", "loss scaling"],
)
def test_what_does_not_compose_with_a_pipeline_yet_is_refused(config, match):
    model = SkipAcross()
    pipeline = PipelineParallel(stages=2, microbatches=2)
    with pytest.raises(ConfigurationError, match=match):
        transpile(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config, mesh=StaticWorld(size=2), pipeline=pipeline
        )


def test_a_pipeline_runs_on_as_many_ranks_as_stages():
    model = SkipAcross()
    pipeline = PipelineParallel(stages=3, microbatches=4)
    with pytest.raises(ConfigurationError, match=r"a pipeline of 3 stages runs on 3 ranks, one per stage; the world"):
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh=StaticWorld(size=2), pipeline=pipeline)


@settings(max_examples=120, deadline=None)
@given(
    stages=st.integers(2, 6),
    microbatches=st.integers(1, 12),
    schedule=st.sampled_from(SCHEDULES),
    virtual=st.integers(2, 3),
)
def test_every_order_runs_each_microbatch_once_without_waiting_forever(stages, microbatches, schedule, virtual):
    virtual = virtual if schedule == "interleaved_1f1b" else 1
    refused = refusal(schedule, stages, microbatches, virtual)
    if refused is not None:
        assert schedule == "1f1b" and microbatches < stages or schedule == "interleaved_1f1b" and microbatches % stages
        with pytest.raises(ConfigurationError, match="needs at least as many microbatches|multiple of"):
            stage_order(schedule, stages, microbatches, 0, virtual)
        return
    orders = [stage_order(schedule, stages, microbatches, s, virtual) for s in range(stages)]
    rounds = check_orders(orders)
    kinds = ("F", "B", "W") if schedule == "zbh1" else ("F", "B")
    for s, order in enumerate(orders):
        chunks = range(s, stages * virtual, stages)
        assert sorted(order) == sorted((kind, i, c) for kind in kinds for i in range(microbatches) for c in chunks)
        last = "W" if schedule == "zbh1" else "B"  # the weights' gradients: made, and so added, in microbatch order
        for c in chunks:
            assert [i for kind, i, chunk in order if kind == last and chunk == c] == list(range(microbatches))
        waiting = peak = 0  # microbatches whose input gradient is not made yet: 1F1B's bound on what a stage holds
        for kind, _, _ in order:
            waiting += {"F": 1, "B": -1, "W": 0}[kind]
            peak = max(peak, waiting)
        if schedule == "interleaved_1f1b":  # chunk-microbatches held: the warm-up's, and one more in the steady state
            assert peak <= min(2 * (stages - s - 1) + (virtual - 1) * stages + 1, microbatches * virtual)
        else:
            assert peak == (microbatches if schedule == "gpipe" else min(microbatches, stages - s))
        if schedule == "zbh1":  # ZB-H1 holds what 1F1B's first stage holds: p microbatches await their weights' part
            awaiting = itertools.accumulate({"F": 1, "B": 0, "W": -1}[kind] for kind, _, _ in order)
            assert max(awaiting) <= min(stages, microbatches)
    if schedule in ("gpipe", "1f1b"):  # unit-time forwards and backwards: the ideal length, m + p - 1 of each
        assert len(rounds) == 2 * (microbatches + stages - 1)
    elif schedule == "interleaved_1f1b":  # chunks of 1/v a stage's time: the bubble is 1/v of 1F1B's
        assert len(rounds) == 2 * (microbatches * virtual + stages - 1)
    elif microbatches >= stages:  # forward, input and weight gradients alike: p - 1 idle units, a third of 1F1B's
        assert len(rounds) == 3 * microbatches + stages - 1


def finish_time(orders: list[list[tuple]], cost) -> float:
    """When the last stage's last action ends, each stage running its order as soon as what it reads is made
    (a forward the stage before's forward, an input gradient its forward and the stage after's input gradient, a
    weights' gradient its input gradient); ``cost(stage, kind)`` is an action's time."""
    ends: dict[tuple, float] = {}
    free, heads, last = [0.0] * len(orders), [0] * len(orders), len(orders) - 1
    while any(h < len(o) for h, o in zip(heads, orders)):
        for s, order in enumerate(orders):
            while heads[s] < len(order):
                kind, i, _ = order[heads[s]]
                reads = {"F": [("F", i, s - 1)] if s else [], "W": [("B", i, s)]}.get(
                    kind, [("F", i, s)] + ([("B", i, s + 1)] if s < last else [])
                )
                if any(r not in ends for r in reads):
                    break
                free[s] = max([free[s]] + [ends[r] for r in reads]) + cost(s, kind)
                ends[(kind, i, s)] = free[s]
                heads[s] += 1
    return max(free)


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(2, 6), extra=st.integers(0, 8))
def test_zbh1_keeps_its_length_where_the_first_stage_has_no_input_gradient(stages, extra):
    """The first stage's input is the batch: its input gradient is empty and its whole backward is the weights'
    part (two units). ZB-H1's order still ends after 3m + p - 1 units, against 1F1B's 3(m + p - 1)."""
    m = stages + extra
    zbh1 = [stage_order("zbh1", stages, m, s) for s in range(stages)]
    one_f_one_b = [stage_order("1f1b", stages, m, s) for s in range(stages)]
    first_stage = {"B": 0.0, "W": 2.0}
    assert finish_time(zbh1, lambda s, kind: first_stage.get(kind, 1.0) if s == 0 else 1.0) == 3 * m + stages - 1
    assert finish_time(one_f_one_b, lambda s, kind: 2.0 if kind == "B" else 1.0) == 3 * (m + stages - 1)
