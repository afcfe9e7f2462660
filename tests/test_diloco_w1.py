"""DiLoCo in one process: world size 1 against eager PyTorch written out here, the schedule and fragments as
properties, the verifiers, the static programs of a world of 2, and the errors.

At world size 1 the mean pseudo-gradient is the replica's own Δ, so ``diloco`` must be exactly the eager loop:
H inner steps, then ``torch.optim`` outer step on θ_global with ``grad = θ_global - θ``, then θ = θ_global.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from bench.tiny_models import MLP, TiedLM, make_batch
from passes.partitions import module_fragments
from tests.helpers import EXCHANGE_OPS, exchange_ops_run
from transpiler import (
    Accumulation,
    Clipping,
    ConfigurationError,
    DiLoCo,
    Execution,
    LossScaling,
    StaticWorld,
    StreamingDiLoCo,
    VerificationError,
    mode_config,
    transpile,
)
from transpiler.cli import main as cli_main
from transpiler.graph.verify import check_fragments, check_outer_reads_averaged, check_shards
from transpiler.strategies.schedules import StreamingDiLoCoSchedule

LOSS = nn.CrossEntropyLoss()
H = 3
FACTORY = str(Path(__file__).parents[1] / "bench" / "tiny_models.py") + ":tiny_factory"


def data(n: int, size: int = 8, seed: int = 1, name: str = "mlp") -> list:
    gen = torch.Generator().manual_seed(seed)
    return [make_batch(name, size, gen) for _ in range(n)]


class EagerDiLoCo:
    """One replica of the paper's loop, eager: ``inner_step`` on each batch, every ``H`` updates Δ = θ - θ_local;
    ``delay`` updates later the outer step on Δ and the local weights become ``α·θ_local + (1-α)·θ`` (Streaming
    DiLoCo with one fragment; ``delay=0, alpha=0`` is DiLoCo)."""

    def __init__(self, model, inner, outer_factory, accumulate=1, clip=0.0, delay=0, alpha=0.0):
        self.model, self.inner = model, inner
        self.theta = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        self.outer = outer_factory(self.theta)
        self.accumulate, self.clip, self.delay, self.alpha = accumulate, clip, delay, alpha
        self.calls, self.deltas, self.started = 0, None, None

    def __call__(self, x, y, autocast: torch.dtype | None = None) -> None:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = LOSS(self.model(x), y)
        (loss / self.accumulate).backward()
        self.calls += 1
        if self.calls % self.accumulate:
            return
        if self.clip:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.inner.step()
        self.inner.zero_grad()
        update = self.calls // self.accumulate
        if update % H == 0:
            self.deltas = [theta.detach() - p.detach() for theta, p in zip(self.theta, self.model.parameters())]
            self.started = update
        if self.deltas is not None and update == self.started + self.delay:
            for theta, delta in zip(self.theta, self.deltas):
                theta.grad = delta
            self.outer.step()
            with torch.no_grad():
                for theta, p in zip(self.theta, self.model.parameters()):
                    p.copy_(self.alpha * p + (1 - self.alpha) * theta if self.alpha else theta)
            self.deltas = None


def nesterov(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def assert_same(model_a: nn.Module, model_b: nn.Module) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max().item():.3g}"


@pytest.mark.bitwise
@pytest.mark.parametrize(
    "case",
    ["adamw", "accumulation_and_clipping", "autocast", "generic_outer", "streaming_accumulation"],
)
def test_world1_is_the_eager_loop(case):
    """Bitwise, 4 outer rounds. ``generic_outer``: an outer RMSprop (no twin: its own step() traced) whose state
    is created at the first sync, so the sync program is traced again once; ``autocast``: bfloat16 forward."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    outer_factory = nesterov
    options: dict = {}
    kwargs: dict = {}
    autocast = None
    mode = "diloco"
    if case == "accumulation_and_clipping":
        options = {"accumulation": Accumulation(steps=2), "clipping": Clipping(max_norm=0.05)}
    if case == "streaming_accumulation":  # one fragment, exchange applied one update later, mixed half and half
        mode = "streaming_diloco"
        options = {
            "accumulation": Accumulation(steps=2),
            "fragments": 1,
            "fragment_sync_delay": 1,
            "fragment_update_alpha": 0.5,
        }
    if case == "generic_outer":

        def outer_factory(params):
            return torch.optim.RMSprop(params, lr=0.01)

        kwargs["outer_optimizer"] = outer_factory(model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    step = transpile(model, inner, mode_config(mode, sync_every=H, **options), LOSS, **kwargs)
    eager = EagerDiLoCo(
        twin,
        torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.01),
        outer_factory,
        accumulate=options["accumulation"].steps if "accumulation" in options else 1,
        clip=options["clipping"].max_norm if "clipping" in options else 0.0,
        delay=options.get("fragment_sync_delay", 0),
        alpha=options.get("fragment_update_alpha", 0.0),
    )
    if case == "autocast":
        autocast = torch.bfloat16
    rounds = 4 * H * (options["accumulation"].steps if "accumulation" in options else 1)
    for x, y in data(rounds):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            step(x, y)
        eager(x, y, autocast)
        assert_same(model, twin)
    for theta, (name, held) in zip(eager.theta, step.global_parameters().items()):
        assert torch.equal(theta.detach(), held), name
    if case == "generic_outer":
        assert step.traces == 2, "traced again once, after the first sync created RMSprop's state"
        assert set(step.outer_optimizer.state[next(model.parameters())]) == {"step", "square_avg"}


@given(
    sync_every=st.integers(1, 40),
    fragments=st.integers(1, 8),
    delay=st.integers(0, 6),
    steps=st.integers(1, 120),
)
def test_streaming_schedule_staggers_fragments(sync_every, fragments, delay, steps):
    """Each fragment starts once in every H steps; a start is finished exactly τ steps later; at most one
    fragment is in flight at any step; a schedule the options cannot keep is refused up front."""
    try:
        schedule = StreamingDiLoCoSchedule(sync_every, fragments, delay)
    except ConfigurationError:
        offsets = sorted({(p + 1) * sync_every // fragments for p in range(fragments)})
        gaps = [b - a for a, b in zip(offsets, [*offsets[1:], offsets[0] + sync_every])]
        assert fragments > sync_every or delay >= min(gaps)
        return
    variants = [schedule.at(t) for t in range(1, steps + 1)]
    in_flight: dict[int, int] = {}
    for t, v in enumerate(variants, start=1):
        if v.startswith("sync"):
            p = int(v[4:])
            if delay:
                assert not in_flight, f"step {t}: fragment {p} starts with {in_flight} in flight"
                in_flight[p] = t
        elif v.startswith("apply"):
            p = int(v[5:])
            assert in_flight.pop(p) == t - delay
    for p in range(fragments):
        starts = [t for t, v in enumerate(variants, start=1) if v == f"sync{p}"]
        assert all(b - a == sync_every for a, b in zip(starts, starts[1:]))
        assert starts == [t for t in range((p + 1) * sync_every // fragments, steps + 1, sync_every)]


@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12), per=st.integers(1, 3), fragments=st.integers(1, 6))
def test_fragments_are_whole_modules_in_order_and_balanced(sizes, per, fragments):
    """Every parameter in exactly one fragment; a module's parameters together; fragments consecutive, none
    empty; none larger than its fair share plus one module."""
    params = [(f"m{i}.p{j}", s) for i, s in enumerate(sizes) for j in range(per)]
    if fragments > len(sizes):
        with pytest.raises(ConfigurationError, match="whole modules"):
            module_fragments(params, fragments)
        return
    parts = module_fragments(params, fragments)
    assert list(parts) == [n for n, _ in params]
    order = list(parts.values())
    assert order == sorted(order) and set(order) == set(range(fragments))
    for i in range(len(sizes)):
        assert len({parts[f"m{i}.p{j}"] for j in range(per)}) == 1
    total = sum(s for _, s in params)
    for p in range(fragments):
        held = sum(s for n, s in params if parts[n] == p)
        assert held <= total / fragments + max(sizes) * per


def static(mode: str = "streaming_diloco", world: int = 2, **options):
    torch.manual_seed(0)
    model = MLP()
    batch = data(1)[0]
    return transpile(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        mode_config(mode, **options),
        LOSS,
        example_inputs=batch,
        mesh=StaticWorld(size=world, rank=0),
    )


def test_static_programs_of_a_world_and_their_variants():
    step = static(sync_every=4, fragments=2, fragment_sync_delay=1, exchange_dtype="int4")
    assert list(step.programs) == ["inner", "sync0", "apply0", "sync1", "apply1"] == list(step.schedule.variants)
    kinds = {
        v: [n.target._schema.name.split("::")[-1] for n in p.graph.nodes if "collective" in n.meta]
        for v, p in step.programs.items()
    }
    assert kinds == {
        "inner": [],
        "sync0": ["all_to_all_single"],
        "sync1": ["all_to_all_single"],
        "apply0": ["all_gather_into_tensor"],
        "apply1": ["all_gather_into_tensor"],
    }
    carried = [p for p in step.programs["sync0"].outputs if p.kind == "extra" and p.name.startswith("inflight.")]
    assert [p.name for p in carried] == ["inflight.0"]


@pytest.mark.parametrize(("sync_every", "delay"), [(4, 1), (8, 2)])
def test_an_exchange_started_earlier_goes_on_behind_the_applying_steps_backward(sync_every, delay):
    """A low-precision exchange is two collectives: the all-to-all the sync step starts, then an all-gather of each
    rank's summed chunk. The applying step issues that all-gather where its forward ends and waits for it after its
    backward, so that it runs behind the backward; at the step's end it was on the critical path (issue 64: at
    20 Mbit/s, bench/wan.py)."""
    step = static(sync_every=sync_every, fragments=2, fragment_sync_delay=delay, exchange_dtype="int4")
    nodes = list(step.programs["apply0"].graph.nodes)
    at = {node: i for i, node in enumerate(nodes)}
    (gather,) = [n for n in nodes if "collective" in n.meta]
    (waited,) = [n for n in nodes if n.target == torch.ops._c10d_functional.wait_tensor.default and gather in n.args]
    backward = [at[n] for n in nodes if n.meta.get("role") == "backward"]
    assert at[gather] < backward[0] and at[waited] > backward[-1], (at[gather], at[waited], backward[0], backward[-1])


def collectives_by_group(step) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each variant's collectives as (kind, the ranks of its group), in graph order."""
    groups = {name: ranks for ranks, name in step.programs["sync"].subgroups.items()}
    return {
        v: [(n.meta["collective"]["kind"], groups[n.args[-1]]) for n in p.graph.nodes if "collective" in n.meta]
        for v, p in step.programs.items()
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_inside_a_replica_shards_within_it_and_syncs_across(stage):
    """W=4 as two replicas of ranks (0, 1) and (2, 3), seen from rank 0: the gradient buckets reduce-scatter and the
    updated halves all-gather inside the replica, clipping's partial norms are summed there too, the
    pseudo-gradients go across (ranks 0 and 2), and rank 0 updates about half of the elements. Under ZeRO-2 an
    accumulation micro-step reduce-scatters inside the replica; under ZeRO-1 it communicates nothing."""
    options = {"sync_every": 4, "replica_size": 2, "replica_mode": f"zero{stage}", "clipping": Clipping(max_norm=1.0)}
    step = static("diloco", world=4, accumulation=Accumulation(steps=2), **options)
    comms = collectives_by_group(step)
    inside = [("reduce_scatter", (0, 1)), ("all_reduce", (0, 1)), ("all_gather", (0, 1))]
    assert comms["inner"] == inside
    assert comms["sync"] == inside + [("all_reduce", (0, 2))]
    assert comms["accumulate"] == ([("reduce_scatter", (0, 1))] if stage == 2 else [])
    shards = step.programs["inner"].shards
    total = sum(p.numel() for p in MLP().parameters())
    assert 0.4 * total < sum(hi - lo for lo, hi in shards.values()) < 0.6 * total  # rank 0's half of each bucket


def test_the_shard_check_tiles_each_replica_and_sees_a_gap():
    """The verifier groups ranks by replica: rank 1's and rank 3's halves each follow their replica's rank 0.
    Dropping one half leaves a gap it reports."""
    programs = []
    for rank in range(4):
        torch.manual_seed(0)
        model = MLP()
        options = {"sync_every": 4, "replica_size": 2, "replica_mode": "zero1"}
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        step = transpile(
            model,
            opt,
            mode_config("diloco", **options),
            LOSS,
            example_inputs=data(1)[0],
            mesh=StaticWorld(size=4, rank=rank),
        )
        programs.append(step.programs["inner"])
    check_shards(programs)
    broken = programs[1].clone(rank=1)
    name = next(n for n, (lo, hi) in broken.shards.items() if hi > lo)  # rank 1 ends it: its last elements
    broken.shards[name] = (broken.shards[name][0], broken.shards[name][1] - 1)
    with pytest.raises(VerificationError, match=f"'{name}': the ranks update"):
        check_shards([programs[0], broken, *programs[2:]])


def test_the_verifier_refuses_an_outer_update_reading_a_local_delta():
    step = static("diloco", sync_every=H)
    program = step.programs["sync"].clone()
    averaged = next(n for n in program.graph.nodes if "averaged_delta_of" in n.meta)
    raw = averaged.args[0]  # the sum before the mean...
    while raw.op != "placeholder" and "collective" not in raw.meta:
        raw = raw.args[0]
    delta = raw.args[0] if "collective" in raw.meta else raw  # ...and the rank's own Δ before the all-reduce
    reader = next(u for u in averaged.users if u.meta.get("outer"))
    check_outer_reads_averaged(program, True)
    reader.replace_input_with(averaged, delta)
    with pytest.raises(VerificationError, match="not an averaged pseudo-gradient"):
        check_outer_reads_averaged(program, True)


def test_the_fragment_check_sees_a_parameter_synced_twice_or_a_fragment_skipped():
    step = static(sync_every=4, fragments=2)
    programs = dict(step.programs)
    check_fragments(programs, [StreamingDiLoCoSchedule(4, 2).at(t) for t in range(1, 13)], 4)
    with pytest.raises(VerificationError, match="runs at steps"):
        check_fragments(programs, ["sync0", "sync1"] * 6, 4)
    programs["sync1"] = programs["sync0"]  # fragment 1's parameters never sync, fragment 0's twice
    with pytest.raises(VerificationError, match="exactly one fragment"):
        check_fragments(programs, [StreamingDiLoCoSchedule(4, 2).at(t) for t in range(1, 13)], 4)


def test_cli_dumps_every_variant(capsys):
    options = ["-O", "sync_every=4", "-O", "fragments=2", "-O", "fragment_sync_delay=1"]
    for variant in ("inner", "sync0", "apply1"):
        argv = ["dump", FACTORY, "--mode", "streaming_diloco", *options, "--variant", variant]
        assert cli_main(argv) == 0
        out = capsys.readouterr().out
        assert ("wait_tensor" in out) == (variant == "apply1")
        assert ("all_reduce" in out) == (variant == "sync0")


def test_cli_schedule_shows_each_exchange_started_and_finished_a_call_later(capsys):
    options = ["-O", "sync_every=4", "-O", "fragments=2", "-O", "fragment_sync_delay=1", "-O", "exchange_dtype=int4"]
    assert cli_main(["dump", FACTORY, "--mode", "streaming_diloco", *options, "--schedule", "7"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[1], r[3], r[4].rstrip(" |")) for r in rows] == [  # fragment p starts at calls ≡ (p+1)·H/P (mod H)
        ("inner", "–", "–"),
        ("sync0", "inflight.0", "–"),
        ("apply0", "–", "inflight.0"),
        ("sync1", "inflight.1", "–"),
        ("apply1", "–", "inflight.1"),
        ("sync0", "inflight.0", "–"),
        ("apply0", "–", "inflight.0"),
    ]
    assert rows[1][2].startswith("all_to_all_single") and rows[2][2].startswith("all_gather_into_tensor")


@pytest.mark.parametrize(
    ("mode", "options", "outer", "match"),
    [
        ("fused_allreduce", {}, "sgd", "only applies to modes 'diloco' and 'streaming_diloco'"),
        ("diloco", {}, "other_params", "same parameters as the inner optimizer"),
        ("streaming_diloco", {}, "adam", "keep no step count per param group"),
        ("streaming_diloco", {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, None, "delay below 2"),
        ("streaming_diloco", {"sync_every": 2, "fragments": 3}, None, "at most sync_every fragments"),
        ("diloco", {"loss_scaling": LossScaling()}, None, "'loss_scaling' works with"),
        ("streaming_diloco", {"exchange_dtype": "int3"}, None, "exchange_dtype"),
        ("diloco", {"execution": Execution(cuda_graph=True)}, None, "cuda_graph=True is not built for mode 'diloco'"),
        ("diloco", {"replica_size": 2}, None, "replica_size=2 does not divide the world size 1"),
        ("diloco", {"replica_mode": "zero2"}, None, "replica_size=1 makes every rank its own replica"),
        ("diloco", {"replica_mode": "zero3"}, None, "replica_mode"),
    ],
)
def test_clear_errors(mode, options, outer, match):
    model = MLP()
    outers = {
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.7),
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=0.1),
        "other_params": lambda: torch.optim.SGD(list(model.parameters())[:2], lr=0.7),
    }
    kwargs = {"outer_optimizer": outers[outer]()} if outer else {}
    options = dict(options)
    if "execution" in options:
        kwargs["execution"] = options.pop("execution")
    with pytest.raises(ConfigurationError, match=match):
        transpile(model, torch.optim.AdamW(model.parameters()), mode_config(mode, **options), LOSS, **kwargs)


def test_more_fragments_than_modules_is_refused_when_traced():
    model = TiedLM()
    with pytest.raises(ConfigurationError, match="use at most 2"):
        transpile(
            model,
            torch.optim.AdamW(model.parameters()),
            StreamingDiLoCo(sync_every=8, fragments=3),
            LOSS,
            example_inputs=data(1, name="tied")[0],
        )


def test_global_weights_before_any_step_are_the_parameters_and_other_modes_have_none():
    model = MLP()
    step = transpile(model, torch.optim.AdamW(model.parameters()), DiLoCo(sync_every=H), LOSS)
    held = step.global_parameters()
    assert all(torch.equal(held[n], p) for n, p in model.named_parameters())
    plain = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "fused_allreduce", LOSS)
    with pytest.raises(ConfigurationError, match="no global weights"):
        plain.global_parameters()


@pytest.mark.parametrize("mode", ["diloco", "streaming_diloco", "sparseloco"])
def test_compiled_programs_follow_the_uncompiled_ones_and_compile_once(mode):
    """compile=True over 4 outer rounds: each variant compiles once (the exchange carried between two compiled
    programs included; SparseLoCo's message read in place, its float32 parts 4-byte aligned; its top-k, packing
    and decoding compiled too: no opaque exchange op runs, where the uncompiled sync runs one each), and the weights
    stay within 1e-5 of the uncompiled step's (Inductor fuses and rounds otherwise)."""
    options = {"sync_every": 4}
    if mode == "streaming_diloco":
        options |= {"fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5, "exchange_dtype": "int4"}
    torch.manual_seed(0)
    base = MLP()
    models = {flag: copy.deepcopy(base) for flag in (False, True)}
    steps = {
        flag: transpile(
            m,
            torch.optim.AdamW(m.parameters(), lr=0.01),
            mode_config(mode, **options),
            LOSS,
            execution=Execution(compile=flag),
        )
        for flag, m in models.items()
    }
    torch._dynamo.utils.counters.clear()
    ran: dict[bool, set[str]] = {flag: set() for flag in steps}
    for x, y in data(16):
        for flag, step in steps.items():
            ran[flag] |= exchange_ops_run(step, (x, y))
    assert ran == {False: EXCHANGE_OPS if mode == "sparseloco" else set(), True: set()}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(steps[True].programs)
    for (name, a), b in zip(models[True].named_parameters(), models[False].parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    assert set(steps[True].compile_seconds) == set(steps[True].programs)
    assert steps[True].traces == 1
    for step in steps.values():
        step.state_dict()  # waits for an exchange in flight: none is left unwaited when the process ends


def _trained(mode: str, steps: int, seed: int = 0, **options):
    torch.manual_seed(seed)
    model = MLP()
    step = transpile(model, torch.optim.AdamW(model.parameters(), lr=0.01), mode_config(mode, **options), loss_fn=LOSS)
    for batch in data(steps):
        step(*batch)
    return model, step


STREAM_1 = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}


def test_a_world1_dcp_checkpoint_resumes_bitwise_and_the_checkpointer_waits_for_the_exchange(tmp_path):
    """Without a process group (DCP's one-process path): Streaming DiLoCo saved by a Checkpointer due at step 2,
    where fragment 0's exchange is in flight, is written at step 3 once it has landed; a fresh step that loads it
    ends where the run that never stopped ends."""
    from transpiler import Checkpointer

    torch.manual_seed(0)
    model = MLP()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = transpile(model, inner, mode_config("streaming_diloco", **STREAM_1), loss_fn=LOSS)
    checkpointer = Checkpointer(step, tmp_path, every=2, keep=4)
    written = []
    for batch in data(8):
        step(*batch)
        written.append(checkpointer.step_done())
    # due at 2, 4, 6, 8; fragment 0 starts its exchange at 2 and 6, fragment 1 at 4 and 8, each landing a step later
    assert [w.name[-1] if w else None for w in written] == [None, None, "3", None, "5", None, "7", None]
    _, again = _trained("streaming_diloco", 0, seed=1, **STREAM_1)
    again.load_checkpoint(tmp_path / "step-00000003")
    for batch in data(8)[3:]:
        again(*batch)
    ended = dict(again.model.named_parameters())
    assert all(torch.equal(p, ended[n]) for n, p in model.named_parameters())
    assert all(torch.equal(t, again.global_parameters()[n]) for n, t in step.global_parameters().items())


def test_checkpoints_of_diloco_and_of_modes_in_step_are_not_read_by_each_other(tmp_path):
    from transpiler import CheckpointError

    _, diloco = _trained("diloco", 2, sync_every=H)
    diloco.save_checkpoint(tmp_path / "diloco")
    _, fused = _trained("fused_allreduce", 2)
    fused.save_checkpoint(tmp_path / "fused")
    with pytest.raises(CheckpointError, match="written by a DiLoCo step .* read its 'model' entry"):
        fused.load_checkpoint(tmp_path / "diloco")
    with pytest.raises(CheckpointError, match="a DiLoCo step reads only DiLoCo checkpoints"):
        diloco.load_checkpoint(tmp_path / "fused")
    _, streaming = _trained("streaming_diloco", 2, **STREAM_1)  # step 2 started fragment 0's exchange
    assert "exchange in flight" in streaming.checkpoint_blocked()
    with pytest.raises(CheckpointError, match="exchange in flight"):
        streaming.save_checkpoint(tmp_path / "streaming")
    streaming.state_dict()  # waits for the exchange: none is left unwaited when the process ends


@pytest.mark.parametrize("mode", ["diloco", "streaming_diloco"])
def test_offloaded_global_weights_live_on_the_host_and_change_no_bit(mode, tmp_path):
    """``offload_global=True``: θ_global is host memory, copied to the device where the sync reads it and back
    as its output (nodes that the dump shows); the run is the on-device run bit for bit. Here the device is the
    CPU too: what the copies save on a GPU is measured by tests/test_gpu.py."""
    options = {"sync_every": H} if mode == "diloco" else STREAM_1 | {"fragment_update_alpha": 0.5}
    runs = {}
    for offload in (False, True):
        model, step = _trained(mode, 9, offload_global=offload, **options)
        runs[offload] = [*(p.detach() for p in model.parameters()), *step.global_parameters().values()]
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))
    moved = {
        v: sorted({n.meta["offload"] for n in p.graph.nodes if n.meta.get("offload")}) for v, p in step.programs.items()
    }
    if mode == "diloco":
        assert moved == {"inner": [], "sync": ["to device", "to host"]}
    else:  # the start of an exchange reads θ_global for its Δ; the apply step also writes it back
        assert moved["sync0"] == ["to device"] and moved["apply0"] == ["to device", "to host"]
    assert step.programs[next(v for v in moved if moved[v])].extra_init["global.net.0.weight"].rule == "host_copy_param"
    step.save_checkpoint(tmp_path)  # a checkpoint read onto the device goes back to the host when the step runs
    _, again = _trained(mode, 0, seed=1, offload_global=True, **options)
    again.load_checkpoint(tmp_path)
    again(*data(1)[0])
    assert {t.device.type for t in again.global_parameters().values()} == {"cpu"}
