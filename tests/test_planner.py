"""The planner (issue 76): its cluster files, its cost model's laws, the layouts it ranks and leaves out, and a real
calibration in a world of two.

Static, a written cluster and a profile given by hand (the quick tier's, about 1 s in all), except where a test says
it traces a step (a few seconds each) and the calibration world (full suite only: about 12 s). The pick's accuracy
against measured runs is bench/planner.py's claim (docs/planner.md), never a timed test here.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.test_planner_tensor_parallel import tensor_parallel_pick
from tests.worlds import run_in_world
from transpiler import ConfigurationError, Execution, PipelineParallel, StaticWorld, transpile
from transpiler.cli import main
from transpiler.planner import Cluster, ComputeTimes, Link, StepProfile, plan, profile_step, simple_cluster
from transpiler.planner.candidates import layouts
from transpiler.planner.cluster import ProgramTimes
from transpiler.planner.costs import Layout, estimate
from transpiler.planner.profile import RecomputeLevel
from transpiler.planner.programs import REPLAY_FIXED, REPLAY_PER_KERNEL
from transpiler.planner.search import rank

MIB = 1024 * 1024


def gpt_like(parameters_mib: float = 7.0, forward: float = 0.07, backward: float = 0.13) -> StepProfile:
    """bench/wan.py's GPT as the planner sees it: 149 tensors, AdamW's two state tensors each, 200 ms of compute
    under load; recompute at the least budget halves its peak for a third of a forward more."""
    sizes = [int(parameters_mib * MIB / 149)] * 149
    return StepProfile(
        parameters=tuple((f"blocks.{i // 12}.p{i}", s) for i, s in enumerate(sizes)),  # 13 modules
        other_bytes=0,
        state_bytes=2 * sum(sizes),
        batch_bytes=8 * 64 * 16,
        batch_size=8,
        transient=40 * MIB,
        recompute=(RecomputeLevel(0.0, 20 * MIB, 0.33),),
        largest_module_bytes=sizes[0] * 4,
        blocks=4,
        boundary_bytes=8 * 64 * 256 * 4,
        compute=ComputeTimes(forward, backward, 0.017),
    )


def ranked(profile: StepProfile, cluster: Cluster, optimizer=None, objective: str = "time_to_target"):
    from transpiler.planner.costs import STEPS_FACTORS

    optimizer = optimizer or torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    return rank(profile, cluster, optimizer, objective, STEPS_FACTORS, time.perf_counter())


@pytest.mark.quick
def test_a_link_prices_a_ring_and_prefers_what_was_measured():
    link = Link(bandwidth=1e6, latency=1e-3)
    assert link.seconds("all_reduce", 4e6, 4) == pytest.approx(6 * 1e-3 + 1.5 * 4.0)
    assert link.seconds("all_gather", 4e6, 4) == pytest.approx(3 * 1e-3 + 0.75 * 4.0)
    assert link.seconds("p2p", 1e6, 2) == pytest.approx(1e-3 + 1.0)
    assert link.seconds("all_reduce", 4e6, 1) == 0.0
    measured = Link(bandwidth=1e6, latency=1e-3, measured={"all_reduce": (0.5, 1e-6, 4)})
    assert measured.seconds("all_reduce", 1e6, 4) == pytest.approx(1.5)
    assert measured.seconds("all_reduce", 1e6, 2) == link.seconds("all_reduce", 1e6, 2)  # fitted at 4 ranks only


@pytest.mark.quick
def test_a_cluster_file_round_trips_and_a_bad_one_says_what_is_wrong(tmp_path):
    cluster = simple_cluster(4, 2, network_mbit=100, memory_mib=512)
    path = tmp_path / "cluster.json"
    cluster.save(path)
    again = Cluster.load(path)
    assert again.to_dict() == cluster.to_dict() and again.world_size == 8
    assert again.link_for(2) is again.host_link and again.link_for(4) is again.network_link
    data = json.loads(path.read_text())
    for broken, words in [
        ({**data, "links": {"host": data["links"]["host"]}}, "links.network"),
        ({**data, "racks": 2}, "unknown cluster fields"),
        ({**data, "hosts": 0}, "at least one host"),
        ({**data, "links": {**data["links"], "network": {"mbit": -1}}}, "mbit must be positive"),
    ]:
        with pytest.raises(ConfigurationError, match=words):
            Cluster.from_dict(broken)
    with pytest.raises(ConfigurationError, match="cannot read"):
        Cluster.load(tmp_path / "missing.json")


@pytest.mark.quick
@settings(max_examples=40, deadline=None)
@given(
    hosts=st.sampled_from([1, 2, 4]),
    per_host=st.sampled_from([1, 2]),
    mbit=st.floats(5, 100_000),
    memory=st.floats(10, 400),
)
def test_every_layout_is_ranked_within_memory_or_left_out_with_a_reason(hosts, per_host, mbit, memory):
    profile, cluster = gpt_like(), simple_cluster(hosts, per_host, mbit, memory)
    made = ranked(profile, cluster)
    assert all(c.estimate.peak <= cluster.memory_per_rank for c in made.ranked)
    scores = [made.score(c) for c in made.ranked]
    assert scores == sorted(scores)
    space, _ = layouts(profile, cluster)
    seen = {c.label for c in made.ranked} | {r.label for r in made.rejected}
    assert {layout.label for layout in space} <= seen
    assert all(r.reason for r in made.rejected)
    over = [r for r in made.rejected if r.reason.startswith("over memory")]
    assert all(r.estimate.peak > cluster.memory_per_rank for r in over)


@pytest.mark.quick
@settings(max_examples=40, deadline=None)
@given(fast=st.floats(10, 100_000), slower=st.floats(0.05, 0.95), hosts=st.sampled_from([2, 4]))
def test_a_slower_link_never_makes_a_layout_faster(fast, slower, hosts):
    profile = gpt_like()
    quick, slow = simple_cluster(hosts, 1, fast, 1e4), simple_cluster(hosts, 1, fast * slower, 1e4)
    for layout in layouts(profile, quick)[0]:
        before, after = (estimate(layout, profile, c, {}) for c in (quick, slow))
        assert after.step >= before.step - 1e-12, layout.label
        assert after.peak == before.peak and after.sent == before.sent


@pytest.mark.quick
def test_each_zero_stage_holds_less_and_recompute_lowers_the_peak():
    """On a GPU each stage's peak is below the one before. On the CPU zero3's one unit of every parameter is
    gathered whole at its peak, above zero2's (bench/planner.py measured 45 MiB against 41 on the GPT)."""
    profile, cluster = gpt_like(), simple_cluster(4, 1, 1000, 1e4)
    modes = ("fused_allreduce", "zero1", "zero2", "zero3")
    peaks = {m: estimate(Layout(m, 4), profile, dataclasses.replace(cluster, device="cuda"), {}).peak for m in modes}
    assert peaks["zero3"] < peaks["zero2"] < peaks["zero1"] < peaks["fused_allreduce"]
    cpu = {m: estimate(Layout(m, 4), profile, cluster, {}).peak for m in modes}
    assert cpu["zero2"] < cpu["zero1"] < cpu["fused_allreduce"] and cpu["zero3"] > cpu["zero2"]
    plain, fitted = (estimate(Layout("zero1", 4, memory_budget=b), profile, cluster, {}) for b in (None, 0.0))
    assert fitted.peak == plain.peak - 20 * MIB and fitted.compute == pytest.approx(plain.compute + 0.33 * 0.07)


@pytest.mark.quick
def test_the_docs_hand_rules_fall_out_of_the_cost_model():
    profile = gpt_like()
    slow = ranked(profile, simple_cluster(4, 1, 20, 1e4))
    assert slow.best.config.mode == "streaming_diloco"  # below 100 Mbit/s (docs/strategies/low_communication.md)
    one_host = ranked(profile, simple_cluster(1, 4, 20, 1e4))  # four ranks on one host's 100 Gbit/s
    assert one_host.best.config.mode in ("fused_allreduce", "zero1", "zero2", "zero3")  # data parallel, exact
    fused = estimate(Layout("fused_allreduce", 4), profile, one_host.cluster, {}).peak
    zero3 = estimate(Layout("zero3", 4), profile, one_host.cluster, {}).peak
    tight = ranked(profile, simple_cluster(1, 4, 20, (fused + zero3) / 2 / MIB))
    assert "fused_allreduce" in {r.label for r in tight.rejected if r.reason.startswith("over memory")}
    assert tight.best.estimate.peak < fused
    none_fit = ranked(profile, simple_cluster(1, 4, 20, 1))
    assert not none_fit.ranked
    with pytest.raises(
        ConfigurationError,
        match=r"no layout fits in 1.0 MiB per rank: the least any needs is [\d.]+ MiB \(pipeline",
    ):
        _ = none_fit.best


@pytest.mark.quick
def test_demo_needs_plain_sgd_and_the_steps_factors_can_be_overridden():
    profile, cluster = gpt_like(), simple_cluster(4, 1, 20, 1e4)
    adamw = ranked(profile, cluster)
    assert any(r.label == "demo" and "SGD" in r.reason for r in adamw.rejected)
    sgd = ranked(profile, cluster, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert "demo" in {c.label for c in sgd.ranked}
    with pytest.raises(ConfigurationError, match="unknown keys"):
        plan(None, None, None, (), cluster, steps_factors={"diloco H=7": 1.0}, profile=profile)
    with pytest.raises(ConfigurationError, match="objective"):
        plan(None, None, None, (), cluster, objective="fastest", profile=profile)
    even = plan(
        None,
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))]),
        None,
        (),
        cluster,
        profile=profile,
        steps_factors={"streaming_diloco": 3.0},
    )
    assert even.best.config.mode != "streaming_diloco"


def gpu_programs(compiled: bool = True, captured: bool = True) -> dict[str, ProgramTimes]:
    """GPT-2's program (mode ``none``) on an H200 as a calibration measured it (2026-11-29): host-bound uncaptured
    (39.8 ms for 34.3 ms of kernels), 11.6 ms of kernels compiled, after a 94 s first call."""
    default = ProgramTimes(wall=0.0398, device=0.0343, kernels=2547, peak=7_748 * MIB, first_call=5.8)
    capture = ProgramTimes(wall=0.0345, device=0.0343, kernels=2551, peak=7_800 * MIB, first_call=7.0)
    compiled_program = ProgramTimes(wall=0.0171, device=0.0116, kernels=653, peak=5_081 * MIB, first_call=93.5)
    return {"default": default, **({"cuda_graph": capture} if captured else {})} | (
        {"compile": compiled_program} if compiled else {}
    )


@pytest.mark.quick
def test_on_a_gpu_the_flags_are_priced_from_the_measured_programs_and_a_compile_pays_for_itself_or_not(tmp_path):
    gpu = dataclasses.replace(simple_cluster(1, 1, 1000, 40_000, device="cuda"), programs=gpu_programs())
    gpu.save(tmp_path / "gpu.json")
    assert Cluster.load(tmp_path / "gpu.json").programs == gpu.programs
    made = ranked(gpt_like(), gpu, objective="step_time")
    order = [c.label for c in made.ranked]
    assert order == [
        "fused_allreduce, compiled, captured",
        "fused_allreduce, compiled",
        "fused_allreduce, captured",
        "fused_allreduce",
    ]
    # at one rank nothing is sent: each step is its program's, compiled and captured the compiled program's device
    # time plus the replay's cost measured on the uncompiled one
    steps = [c.estimate.step for c in made.ranked]
    assert steps == pytest.approx([0.0116 + (0.0345 - 0.0343), 0.0171, 0.0345, 0.0398])
    best = made.best
    assert best.estimate.peak - made.ranked[-1].estimate.peak == (5_081 - 7_748) * MIB
    assert best.execution.compile and best.execution.cuda_graph and best.estimate.setup == 93.5
    assert "setup (s)" in made.table()
    # a run of 1,000 steps does not earn back a 94 s compile: 11.8 ms + 94 ms a step against 34.5 + 7 ms captured
    short = rank(gpt_like(), gpu, torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), "step_time", {}, 0.0, 1000)
    assert short.best.label == "fused_allreduce, captured"
    # a capture not measured (a cluster file by hand): a replay at the constants
    unmeasured = ranked(
        gpt_like(), dataclasses.replace(gpu, programs=gpu_programs(captured=False)), objective="step_time"
    )
    assert unmeasured.best.estimate.step == pytest.approx(0.0116 + REPLAY_FIXED + 653 * REPLAY_PER_KERNEL)
    # nothing compiled measured: the compiled layouts are left out with the command that measures them
    uncompiled = ranked(gpt_like(), dataclasses.replace(gpu, programs=gpu_programs(compiled=False)))
    assert [c.label for c in uncompiled.ranked] == ["fused_allreduce, captured", "fused_allreduce"]
    assert any("calibrate --compile" in r.reason for r in uncompiled.rejected)
    # the generic optimizer path computes its step sizes in Python: never captured
    generic = ranked(gpt_like(), gpu, torch.optim.Adagrad([nn.Parameter(torch.zeros(1))]))
    assert {c.label for c in generic.ranked} == {"fused_allreduce", "fused_allreduce, compiled"}
    assert all("generic path" in r.reason for r in generic.rejected if "captured" in r.label)
    four = ranked(gpt_like(), dataclasses.replace(gpu, hosts=4))
    assert {c.layout.mode for c in four.ranked if c.layout.cuda_graph} == {"fused_allreduce", "zero1", "zero2", "zero3"}
    with pytest.raises(ConfigurationError, match="'default' always"):
        Cluster.from_dict({**gpu.to_dict(), "programs": {"compile": dataclasses.asdict(gpu.programs["compile"])}})


@pytest.mark.quick
def test_streaming_diloco_takes_no_more_fragments_than_modules_and_a_pipeline_waits_on_its_busiest_stage():
    """A fragment holds whole modules (bench/planner.py's MLP has 3 with parameters, and fragments=4 failed to
    build); a pipeline's slot lasts its busiest stage's share of the step."""
    two = dataclasses.replace(gpt_like(), parameters=(("a.weight", 4 * MIB), ("b.weight", 3 * MIB)))
    streaming = next(
        c for c in ranked(two, simple_cluster(4, 1, 20, 1e4)).ranked if c.config.mode == "streaming_diloco"
    )
    assert streaming.label == "streaming_diloco fragments=2" and streaming.config.fragments == 2
    cluster, even = simple_cluster(4, 1, 1000, 1e4), gpt_like()
    uneven = dataclasses.replace(even, segment_seconds=(0.0, 1.0, 1.0, 1.0, 5.0), segment_bytes=(0, 1, 1, 1, 5))
    slot = {p.segment_seconds: estimate(Layout("none", 1, 4, 8), p, cluster, {}).compute for p in (even, uneven)}
    assert slot[uneven.segment_seconds] > 2 * slot[even.segment_seconds]  # 5/8 of the step on one stage, not 1/4
    peaks = [estimate(Layout("none", 1, 4, 8), p, cluster, {}).peak for p in (even, uneven)]
    assert peaks[1] > peaks[0] + 3 * 7 * MIB * (5 / 8 - 1 / 4) - 1  # parameters and AdamW's state: 5/8 on one stage


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def factory() -> tuple:
    """(model, optimizer, loss_fn, batch): 4 blocks of a Linear and a Tanh, AdamW, a batch of 16 (a FACTORY)."""
    model = torch.manual_seed(0) and Blocks()
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss(), batch


def test_a_real_step_is_profiled_and_its_pick_builds(tmp_path):
    """Traces (about 5 s): the profile's bytes are the model's, and the best candidate's config builds a rank's
    programs as transpile() takes it."""
    model, optimizer, loss_fn, batch = factory()
    profile = profile_step(model, optimizer, loss_fn, batch)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert profile.parameter_bytes == params and profile.blocks == 4
    assert 2 * params <= profile.state_bytes <= 2 * params + 64 * len(profile.parameters)  # exp_avg(_sq), steps
    assert profile.boundary_bytes == 16 * 32 * 4
    assert profile.recompute[0].transient <= profile.transient and profile.compute.step > 0
    made = plan(model, optimizer, loss_fn, batch, simple_cluster(2, 1, 1000, 64), profile=profile)
    data = made.best.config.to_dict()
    step = transpile(model, optimizer, made.best, loss_fn, batch, mesh=StaticWorld(size=2, rank=0))
    assert step.programs and json.loads(made.to_json())["ranked"][0]["config"] == data
    # a pick sets its budget and flags, the execution given keeps the rest; it sets the pipeline itself
    budgeted = next(c for c in made.ranked if c.layout.memory_budget is not None)
    config, execution, _, pipeline = budgeted.transpile_arguments(Execution(timeout=30), None, None)
    assert config == budgeted.config and pipeline is None
    assert execution.memory_budget == budgeted.layout.memory_budget and execution.timeout == 30
    with pytest.raises(ConfigurationError, match="sets the pipeline itself"):
        transpile(model, optimizer, budgeted, loss_fn, batch, pipeline=PipelineParallel(stages=2, microbatches=2))


def test_the_cli_prints_the_plan_and_bad_input_is_one_line(tmp_path, capsys):
    """Traces once (about 5 s)."""
    factory_file = tmp_path / "f.py"
    factory_file.write_text("from tests.test_planner import factory\n")
    out = tmp_path / "plan.json"
    code = main(
        ["plan", f"{factory_file}:factory", "--hosts", "4", "--mbit", "20", "--memory-mib", "64", "--json", str(out)]
    )
    printed = capsys.readouterr()
    assert code == 0 and "| 1 | streaming_diloco |" in printed.out and "Left out:" in printed.out
    assert json.loads(out.read_text())["ranked"][0]["label"] == "streaming_diloco"
    assert main(["plan", f"{factory_file}:factory", "--hosts", "4"]) == 2
    assert "give --cluster FILE.json, or --hosts, --mbit and --memory-mib" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["plan", f"{factory_file}:factory", "--cluster", str(tmp_path / "bad.json")]) == 2
    assert "a cluster needs hosts" in capsys.readouterr().err
    assert (
        main(["plan", f"{factory_file}:factory", "--hosts", "4", "--mbit", "20", "--memory-mib", "64", "--steps", "0"])
        == 2
    )
    assert "steps is the run's length, at least 1; got 0" in capsys.readouterr().err
    assert main(["calibrate", f"{factory_file}:factory", "--memory-mib", "64", "--compile"]) == 2
    assert "--compile prices compile=True on a GPU: give --device cuda too" in capsys.readouterr().err


def calibrated(rank: int, world: int) -> dict:
    """A job of tests/worlds.py: calibrate this world as hosts of one rank, then plan on every rank from rank 0's
    cluster; then plan a small llama for the two ranks on one host with its tensor-parallel plan and run the pick
    of tp=2 (tests/test_planner_tensor_parallel.py)."""
    import torch.distributed as dist

    from transpiler.planner.calibrate import calibrate

    model, optimizer, loss_fn, batch = factory()
    shared = [calibrate((model, optimizer, loss_fn, batch), memory_mib=256, ranks_per_host=1)]
    dist.broadcast_object_list(shared, src=0)
    made = plan(model, optimizer, loss_fn, batch, shared[0])
    result = {"cluster": shared[0].to_dict(), "ranked": [c.label for c in made.ranked], "profile": made.profile}
    return result | {"tensor_parallel": tensor_parallel_pick()}


def test_a_calibration_measures_the_link_and_the_step_in_a_world_of_two(tmp_path):
    """A real world of two on loopback (about 15 s): the fits are positive and price the collectives as measured,
    and both ranks plan alike from rank 0's profile (each rank's own timings once ranked pipelines differently on
    bench/planner.py's ranks, which then built different steps and waited on each other); a tensor-parallel pick
    runs as planned."""
    ranks = run_in_world(2, "tests.test_planner:calibrated", tmp_path, timeout=120)
    assert ranks[0]["ranked"] == ranks[1]["ranked"] and ranks[0]["profile"] == ranks[1]["profile"]
    cluster = Cluster.from_dict(ranks[0]["cluster"])
    assert cluster.hosts == 2 and cluster.ranks_per_host == 1 and cluster.compute.under_load
    measured = cluster.network_link.measured
    assert set(measured) == {"all_reduce", "all_gather", "all_to_all"}
    assert all(ranks == 2 and alpha >= 0 and beta >= 0 for alpha, beta, ranks in measured.values())
    assert measured["all_reduce"][1] > 0 and cluster.network_link.bandwidth > 0
    assert cluster.compute.forward > 0 and cluster.compute.backward > 0
    # the pick of tp=2 applies the plan over its mesh and trains, each rank holding half of every split weight,
    # both computing the same losses, and its program issues on tp the collectives the planner priced
    tp = ranks[0]["tensor_parallel"]
    assert tp["label"] == "fused_allreduce, dp=1×tp=2" and tp["losses"] == ranks[1]["tensor_parallel"]["losses"]
    assert tp["wq"] == (8, 16) and tp["losses"][-1] < tp["losses"][0]
    assert tp["issued"] == tp["counted"] and sum(tp["issued"].values()) == 26
