"""``zero1``/``zero2``/``zero3`` in one process: the shard layout's invariants, world size 1 against eager, the
programs of every rank of a world checked statically, what the modes refuse, and zero3's parameters between
steps (the worlds run in tests/test_zero.py)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.tiny_models import MLP, Lamb, TiedLM, make_batch
from passes.shard_optimizer import owned, unit_threshold
from tests.helpers import eager_step
from tests.test_boost_properties import assert_all_gathers_run_alone
from transpiler import (
    Accumulation,
    Clipping,
    Execution,
    LossScaling,
    PassPipeline,
    StaticWorld,
    TraceCache,
    ZeRO,
    mode_config,
    transpile,
)
from transpiler.build import StepBuilder
from transpiler.errors import (
    CheckpointError,
    ConfigurationError,
    PipelineSpecError,
    UnsupportedOptimizerError,
    VerificationError,
)
from transpiler.graph.bucket_layout import (
    BUCKET_READY,
    SLOT_ALIGN_BYTES,
    SLOT_VIEWS,
    padded_length,
    slot_offsets,
)
from transpiler.graph.collectives import WAIT
from transpiler.graph.cost_model import LinkCost
from transpiler.graph.verify import check_shards
from transpiler.graph.views import flat_range, is_view
from transpiler.runtime.handshake import differences
from transpiler.runtime.sharded_checkpoint import flat_boxes

LOSS = torch.nn.CrossEntropyLoss()
# the tests that hold a step to eager's bits; .ci/run repeats these under narrower kernels (the rest check the
# programs' structure and refusals, which no kernel decides)
BITWISE = pytest.mark.bitwise


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=8),
    itemsize=st.sampled_from([2, 4, 8]),
    world=st.integers(1, 8),
)
def test_shards_tile_every_parameter_and_start_aligned(sizes, itemsize, world):
    starts = slot_offsets(sizes, itemsize)
    length = padded_length(starts[-1] + sizes[-1], itemsize, world)
    assert length % world == 0 and length >= starts[-1] + sizes[-1]
    shard = length // world
    assert (shard * itemsize) % SLOT_ALIGN_BYTES == 0 or world == 1
    for start, n in zip(starts, sizes):
        ranges = [owned(start, n, r, shard) for r in range(world)]
        assert sum(hi - lo for lo, hi in ranges) == n  # every element once
        covered = sorted(r for r in ranges if r[1] > r[0])
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


@BITWISE
@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("opt", ["sgd", "adamw", "lamb"])
def test_world_of_one_is_eager(mode, opt):
    """At world size 1 the shard is everything: eager's bits, for 6 steps (zero3's parameters compared inside
    ``step.gathered()``; its optimizer state is flat). LAMB's norms need no all-reduce there."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        "lamb": lambda ps: Lamb(ps, lr=1e-2),
    }[opt]
    optimizer, ref_opt = make(model.parameters()), make(reference.parameters())
    step = transpile(model, optimizer, mode, loss_fn=LOSS)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        batch = make_batch("tied", 8, gen)
        step(*batch)
        eager_step(reference, ref_opt, LOSS, batch)
        with step.gathered():
            for a, b in zip(model.parameters(), reference.parameters()):
                assert torch.equal(a, b)
    for p, q in zip(model.parameters(), reference.parameters()):
        for key, value in ref_opt.state[q].items():
            assert torch.equal(optimizer.state[p][key].reshape(value.shape), value), key


def _world_programs(mode: str, world: int, optimizer=torch.optim.AdamW, **options) -> list:
    """Every rank's program of a world built ahead. Rank 0's build runs the static cross-rank check, which builds
    and verifies every rank's program; the others are built again unverified, only to be handed back."""
    programs, traces = [], TraceCache()  # the ranks' builds share one trace
    for rank in range(world):
        torch.manual_seed(0)
        model = MLP()
        step = transpile(
            model,
            optimizer(model.parameters()),
            mode_config(mode, bucket_cap_mb=0.004, first_bucket_mb=0.001, **options),
            loss_fn=LOSS,
            example_inputs=make_batch("mlp", 4, torch.Generator().manual_seed(0)),
            trace=traces,
            mesh=StaticWorld(size=world, rank=rank),
            execution=Execution(verify=rank == 0),
        )
        programs.append(step.program)
    return programs


@pytest.mark.quick
def test_static_checks_see_a_rank_that_updates_the_wrong_slice():
    """Programs for every rank of a world of 4 built in one process (as transpile() checks them), then one rank's
    slice moved: ``check_shards`` names the parameter."""
    programs = _world_programs("zero2", 4)
    check_shards(programs)
    name = next(n for n, (lo, hi) in programs[1].shards.items() if hi > lo)
    lo, hi = programs[1].shards[name]
    programs[1].shards[name] = (lo + 1, hi)
    with pytest.raises(VerificationError, match=name):
        check_shards(programs)


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_the_handshake_sees_a_rank_that_updates_the_wrong_slice(mode):
    """In a live world each rank builds only its own programs and the ranks compare them at the startup handshake:
    the setups of a world of 2 agree, and with one rank's slice moved (a gap, then an overlap) every rank would
    raise, naming the parameter."""
    setups = {}
    for rank in range(2):
        torch.manual_seed(0)
        model = MLP()
        batch = make_batch("mlp", 4, torch.Generator().manual_seed(0))
        config = mode_config(mode, bucket_cap_mb=0.004, first_bucket_mb=0.001)
        world = StaticWorld(size=2, rank=rank)
        step = transpile(model, torch.optim.AdamW(model.parameters()), config, LOSS, batch, mesh=world)
        setups[rank] = step.prepare(batch).setup
    assert differences(setups) == []
    assert setups[0].shards and setups[1].shard_place == ("world", 1)
    name, (lo, hi) = next((n, s) for n, s in setups[1].shards.items() if s[1] > s[0])
    for moved, found in (((lo + 1, hi), "updates elements"), ((lo, hi - 1), "the ranks update")):
        broken = {0: setups[0], 1: dataclasses.replace(setups[1], shards={**setups[1].shards, name: moved})}
        (line,) = differences(broken)
        assert f"parameter '{name}'" in line and found in line, line


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_unkept_buckets_are_made_each_step_and_written_in_place(mode):
    """Without kept buckets each bucket is allocated in the step before its first gradient, its padding is
    zeroed (one ``index_fill_``), weight gradients are produced into it (``mm`` with ``out=``), nothing packs
    them (no ``cat``), and the program holds no bucket constant."""
    aten = torch.ops.aten
    program = _world_programs(mode, 4)[1]
    graph = program.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    buffers = [n for n in graph.nodes if n.target is aten.empty.memory_format and "bucket" in n.meta]
    assert buffers and not [n for n in graph.nodes if n.op == "get_attr" and "bucket" in n.meta]
    scattered = [n.args[0] for n in graph.nodes if n.meta.get("collective", {}).get("kind") == "reduce_scatter"]
    assert scattered and all(n.target is BUCKET_READY for n in scattered)
    for buffer in buffers:
        views = [u for u in buffer.users if u.target in SLOT_VIEWS]
        fills = [u for u in buffer.users if u.target is aten.index_fill_.int_Scalar]
        padding = getattr(program.graph_module, fills[0].args[2].target).tolist() if fills else []
        zeroed = [(i, i + 1) for i in padding]  # the padding, zeroed in one op
        slots = sorted(flat_range(v)[1:] for v in views)
        covered = sorted(zeroed + slots)
        assert covered[0][0] == 0 and covered[-1][1] == buffer.meta["val"].numel()
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), "slots and zeroed padding tile the buffer"
        writers = [n for n in graph.nodes if n.target is aten.mm.out and n.kwargs["out"] in views]
        assert writers and all(order[buffer] < order[w] for w in writers)


@pytest.mark.quick
def test_rendered_program_names_each_collective():
    """The reduce-scatters (on the CPU an all-to-all and a local sum each, gloo's cheaper form) come first, the
    all-gathers after the update."""
    program = _world_programs("zero1", 2)[0]
    kinds = [n.meta["collective"]["kind"] for n in program.graph.nodes if "collective" in n.meta]
    assert kinds[: len(kinds) // 2] == ["reduce_scatter"] * (len(kinds) // 2)
    assert kinds[len(kinds) // 2 :] == ["all_gather"] * (len(kinds) // 2)
    code = program.graph_module.code
    comm = [n.target for n in program.graph.nodes if n.meta.get("role") == "communication"]
    a2a, local_sum = torch.ops._c10d_functional.all_to_all_single.default, torch.ops.aten.sum.dim_IntList
    assert comm.count(a2a) == comm.count(local_sum) == len(kinds) // 2
    assert "reduce_scatter_tensor" not in code and "all_to_all_single" in code and "all_gather_into_tensor" in code


def _zero3_pair(example_inputs=None):
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    return model, reference, ref_opt, transpile(model, optimizer, "zero3", LOSS, example_inputs)


@BITWISE
def test_zero3_model_between_steps_holds_slices_and_gathered_gives_it_whole():
    """After a zero3 step the model's parameters are flat slices and running it fails with what to do; inside
    ``step.gathered()`` it is whole and computes what eager's model does; an edit made there is kept (the next
    step starts from it, as eager's does), with ``writeback=False`` dropped; a new batch shape traces again on
    whole stand-ins and stays eager's bits."""
    model, reference, ref_opt, step = _zero3_pair()
    gen = torch.Generator().manual_seed(1)
    batch = make_batch("tied", 8, gen)
    step(*batch)
    eager_step(reference, ref_opt, LOSS, batch)
    assert all(p.dim() == 1 for p in model.parameters() if p.requires_grad)
    with pytest.raises(ConfigurationError, match="step.gathered"):
        model(batch[0])
    with step.gathered() as whole:
        assert torch.equal(whole(batch[0]), reference(batch[0]))
        with torch.no_grad():
            model.proj.bias.add_(1.0)
    with torch.no_grad():
        reference.proj.bias.add_(1.0)
    with step.gathered(writeback=False):
        with torch.no_grad():
            model.proj.bias.mul_(0.0)
        with pytest.raises(ConfigurationError, match="leave the block"):
            step(*batch)
    for size in (8, 6, 8):  # 6: a new shape, traced again while the parameters are slices
        batch = make_batch("tied", size, gen)
        step(*batch)
        eager_step(reference, ref_opt, LOSS, batch)
    assert step.traces == 2
    with step.gathered():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.quick
def test_a_zero3_checkpoint_before_the_first_step_of_a_world_is_refused_in_words():
    """Before the first step the startup has not broadcast rank 0's whole parameters, and a snapshot would cut
    them to this rank's slices first, which the startup could not broadcast: ``state_dict()`` (which a rank may
    call alone) is refused then, saying what to do (it used to pass, and the first step then failed in gloo with a
    size mismatch); ``save_checkpoint`` runs the startup first (``test_zero.py``). A world of one has no slices to
    cut, and saves."""
    batch = make_batch("tied", 8, torch.Generator().manual_seed(1))
    for size in (2, 1):
        torch.manual_seed(0)
        model = TiedLM()
        step = transpile(
            model, torch.optim.AdamW(model.parameters()), "zero3", LOSS, batch, mesh=StaticWorld(size=size)
        )
        if size > 1:
            said = r"before the first step.*save after a step, or call step.save_checkpoint\(path\) or enter"
            with pytest.raises(CheckpointError, match=said):
                step.state_dict()
        else:
            assert "model" in step.state_dict()


@pytest.mark.quick
def test_zero3_refusals_say_what_to_do():
    """Freezing a sharded parameter, and loading a state dict into a step that does not know its slices yet."""
    model, _, _, step = _zero3_pair()
    batch = make_batch("tied", 8, torch.Generator().manual_seed(1))
    step(*batch)
    saved = step.state_dict()
    model.embed.weight.requires_grad_(False)  # held flat (a 1-D parameter's slice at W=1 is itself: allowed)
    with pytest.raises(ConfigurationError, match="frozen"):
        step(*batch)
    _, _, _, fresh = _zero3_pair()
    with pytest.raises(CheckpointError, match="example_inputs"):
        fresh.load_state_dict(saved)
    _, _, _, built = _zero3_pair(example_inputs=batch)
    built.load_state_dict(saved)


def test_zero3_programs_gather_before_use_and_free_before_the_backward():
    """Every rank's zero3 program (W=4, checked statically): each bucket is gathered for the forward, and again
    for the backward where it reads it, except the last the forward reads, whose gather the backward reads first
    and keeps (FSDP2's root); no backward node reads another forward gather (with ``reshard_after_forward``), and
    every all-gather runs alone (CPU)."""
    for reshard in (True, False):
        for program in _world_programs("zero3", 4, reshard_after_forward=reshard):
            gathers = [n for n in program.graph.nodes if n.meta.get("collective", {}).get("kind") == "all_gather"]
            phases = [n.meta["collective"]["phase"] for n in gathers]
            assert phases.count("forward") == len(program.param_buckets)
            assert ("backward" in phases) == reshard
            kept = [n for n in gathers if n.meta["collective"]["phase"] == "forward"][-1]
            again = {n.meta["collective"]["bucket"] for n in gathers if n.meta["collective"]["phase"] == "backward"}
            assert kept.meta["collective"]["bucket"] not in again
            for gather in gathers:
                aliases, readers = {gather}, set()
                for node in program.graph.nodes:
                    if any(i in aliases for i in node.all_input_nodes):
                        (aliases if is_view(node) or node.target is WAIT else readers).add(node)
                late = {r.name for r in readers if r.meta.get("role") in ("loss_grad", "backward")}
                if reshard and gather.meta["collective"]["phase"] == "forward":
                    assert bool(late) == (gather is kept), (gather.name, late)
            assert_all_gathers_run_alone(program.graph)
    check_shards(_world_programs("zero3", 4))


def test_zero3_default_buckets_are_one_layer_each():
    """``bucket_cap_mb="layer"``, what zero3's default ``cost`` falls back to with no all-gather to time (a program
    built without processes): the cap is the gradient bytes of the largest module, so each of
    the MLP's layers is one bucket (its weight and bias together, one gather), and ``decisions`` says so; the
    other modes keep DDP's 25 MB (the whole MLP in one bucket)."""
    model = MLP()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in layers.values())
    example = make_batch("mlp", 4, torch.Generator().manual_seed(0))
    step = transpile(
        model, torch.optim.AdamW(model.parameters()), "zero3", LOSS, example, mesh=StaticWorld(size=2, rank=0)
    )
    modules = [{name.rpartition(".")[0] for name in bucket.names} for bucket in step.program.param_buckets]
    assert sorted(m for group in modules for m in group) == sorted(layers) and all(len(g) == 1 for g in modules)
    assert f"{largest / 2**20:.3g} MiB" in step.program.decisions["shard-optimizer"]
    other = MLP()
    zero2 = transpile(
        other, torch.optim.AdamW(other.parameters()), "zero2", LOSS, example, mesh=StaticWorld(size=2, rank=0)
    )
    reduce_scatters = [
        n for n in zero2.program.graph.nodes if n.meta.get("collective", {}).get("kind") == "reduce_scatter"
    ]
    assert len(reduce_scatters) == 1 and "shard-optimizer" not in zero2.program.decisions


@settings(max_examples=300, deadline=None)
@given(alpha=st.floats(1e-7, 1e-2), beta=st.floats(1e-14, 1e-6))
def test_the_unit_threshold_is_n_half_rounded_to_a_power_of_two(alpha, beta):
    """Hockney's n½ = alpha / beta, rounded to a power of two (within a factor √2 of it), and the decision says
    what was measured and chosen."""
    threshold, why = unit_threshold(LinkCost(alpha, beta, overlaps=True))
    half = max(alpha / beta, 1.0)  # at least one byte
    assert threshold & (threshold - 1) == 0 and half / 2**0.5 <= threshold <= half * 2**0.5, (half, threshold)
    assert why.startswith(f"bucket_cap_mb=cost: an all-gather costs {alpha * 1e6:.0f} us") and "25 MiB" in why


def test_prefetch_issues_nothing_ahead_on_the_cpu_and_takes_a_count():
    """On the CPU every all-gather runs alone, so the prefetch depth leaves the program as it is (on a GPU it is
    the gathers in flight during compute: tests/test_gpu.py); a negative depth is a clear error."""
    graphs = []
    for prefetch in (0, 3):
        torch.manual_seed(0)
        model = Blocks()
        example = (torch.randn(4, 16), torch.randint(0, 10, (4,)))
        config = ZeRO(stage=3, bucket_cap_mb=0.004, prefetch=prefetch)
        step = transpile(model, torch.optim.AdamW(model.parameters()), config, LOSS, example, mesh=StaticWorld(size=2))
        graphs.append(step.program.graph.python_code("self").src)
    assert graphs[0] == graphs[1]
    with pytest.raises(ConfigurationError, match="prefetch"):
        transpile(
            model,
            torch.optim.AdamW(model.parameters()),
            ZeRO(stage=3, prefetch=-1),
            LOSS,
            example,
            mesh=StaticWorld(size=2),
        )


@settings(max_examples=50, deadline=None)
@given(alpha=st.floats(1e-7, 1e-2), beta=st.floats(1e-14, 1e-6))
def test_where_nothing_overlaps_units_fill_to_the_bound(alpha, beta):
    """On the CPU every all-gather runs alone: one more unit only adds its collectives' starts, so no module
    below the 25 MiB bound starts a unit, whatever n½ is, and the decision says why."""
    threshold, why = unit_threshold(LinkCost(alpha, beta, overlaps=False))
    assert threshold == 25 * 2**20
    assert why.startswith(f"bucket_cap_mb=cost: an all-gather costs {alpha * 1e6:.0f} us") and "nothing runs" in why


class Blocks(torch.nn.Module):
    """``n`` blocks of modules of three sizes (a LayerNorm of 128 bytes, Linears of 4352 and 4160 bytes), a head
    of 680 bytes."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        block = lambda: torch.nn.Sequential(  # noqa: E731
            torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)
        )
        self.blocks = torch.nn.Sequential(*(block() for _ in range(n)))
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@pytest.mark.parametrize("half", [100, 2000, 4300, 10**6])
def test_cost_units_start_at_modules_worth_a_collective_and_hold_whole_modules(half, monkeypatch):
    """With a given all-gather cost (a link of n½ = ``half`` bytes), zero3's default units: every module's
    parameters in one unit, units of consecutive modules in production order; a unit starts at a module of at
    least the threshold (n½ as a power of two), and every later module of it is smaller; a model of small modules
    is one unit."""
    link = _link_of(half, monkeypatch)
    torch.manual_seed(0)
    model = Blocks()
    example = (torch.randn(4, 16), torch.randint(0, 10, (4,)))
    step = transpile(
        model, torch.optim.AdamW(model.parameters()), "zero3", LOSS, example, mesh=StaticWorld(size=2, rank=0)
    )
    threshold, why = unit_threshold(link)
    assert step.program.decisions["shard-optimizer"] == why
    produced = [n for n, _ in reversed(list(model.named_parameters()))]  # the backward makes gradients last first
    modules = list(dict.fromkeys(n.rpartition(".")[0] for n in produced))
    units = [list(dict.fromkeys(n.rpartition(".")[0] for n in b.names)) for b in step.program.param_buckets]
    assert [m for unit in units for m in unit] == modules  # whole modules, consecutive, in production order
    size = {m: sum(p.numel() * 4 for n, p in model.named_parameters() if n.rpartition(".")[0] == m) for m in modules}
    assert all(size[unit[0]] >= threshold for unit in units[1:]), (threshold, units)
    assert all(size[m] < threshold for unit in units for m in unit[1:]), (threshold, units)
    assert len(units) == (1 if half > 5000 else len([m for m in modules[1:] if size[m] >= threshold]) + 1)


def test_a_number_for_bucket_cap_mb_overrides_the_measured_cost(monkeypatch):
    """Where the ranks have measured an all-gather cost (one link, as above: the override does not depend on
    which), a number for ``bucket_cap_mb`` still overrides the choice: ``decisions`` records none."""
    _link_of(2000, monkeypatch)
    torch.manual_seed(0)
    model = Blocks()
    example = (torch.randn(4, 16), torch.randint(0, 10, (4,)))
    given = transpile(
        model,
        torch.optim.AdamW(model.parameters()),
        ZeRO(stage=3, bucket_cap_mb=0.004),
        LOSS,
        example,
        mesh=StaticWorld(size=2, rank=0),
    )
    assert "shard-optimizer" not in given.program.decisions


def _link_of(half: int, monkeypatch: pytest.MonkeyPatch) -> LinkCost:
    """An all-gather link of n½ = ``half`` bytes, as the step's ranks would measure it."""
    beta = 1e-9
    link = LinkCost(half * beta, beta, overlaps=True)
    monkeypatch.setattr(StepBuilder, "_link_cost", lambda self: link)
    return link


def test_zero3_in_a_world_of_one_fills_units_to_the_bound():
    """In a world of one nothing moves between ranks, so a gather unit only adds its collectives' dispatch: zero3's
    default ``cost`` puts the modules in one unit up to 25 MiB (on the GPU the narrow GPT had 50 units and 100
    all-gathers a step, where FSDP2 has 13 units), and ``decisions`` says why. ``layer`` still overrides it."""
    torch.manual_seed(0)
    model = Blocks()
    example = (torch.randn(4, 16), torch.randint(0, 10, (4,)))
    step = transpile(
        model, torch.optim.AdamW(model.parameters()), "zero3", LOSS, example, mesh=StaticWorld(size=1, rank=0)
    )
    assert len(step.program.param_buckets) == 1
    assert "in a world of one" in step.program.decisions["shard-optimizer"]
    other = Blocks()
    given = transpile(
        other,
        torch.optim.AdamW(other.parameters()),
        ZeRO(stage=3, bucket_cap_mb="layer"),
        LOSS,
        example,
        mesh=StaticWorld(size=1, rank=0),
    )
    assert len(given.program.param_buckets) > 1
    assert given.program.decisions["shard-optimizer"].startswith("bucket_cap_mb=layer")


def test_zero3_updates_each_bucket_flat_or_all_as_multi_tensor_ops():
    """In float32 each gather unit's update runs once on this rank's flat shard of it (``flatten-update``), and
    no parameter is an input of its own: 13 modules in 10 units (``layer``: a LayerNorm joins the Linear beside
    it). In bfloat16, whose ``add`` rounds differently in a flat buffer, it runs as ``_foreach_*`` ops over every
    parameter, here 61 modules in 42 units: each op reads a gradient slice of every bucket, so
    schedule-collectives moves every bucket's unpacking right before one op; it used to run out of float
    positions between two nodes there and put a sum after the slice that reads it (issue 42)."""
    for dtype, blocks, units in ((torch.float32, 4, 10), (torch.bfloat16, 20, 42)):
        torch.manual_seed(0)
        model = Blocks(blocks).to(dtype)
        example = (torch.randn(4, 16, dtype=dtype), torch.randint(0, 10, (4,)))
        config, world = ZeRO(stage=3, bucket_cap_mb="layer"), StaticWorld(size=2, rank=1)
        program = transpile(model, torch.optim.AdamW(model.parameters()), config, LOSS, example, mesh=world).program
        assert len(program.param_buckets) == units
        flat = [b for b in program.flat_buffers if b.kind == "param"]
        if dtype == torch.float32:
            assert len(flat) == units and "foreach-update" not in program.decisions, program.decisions
            assert not [p for p in program.inputs if p.kind == "param"]
        else:
            count = len(list(model.parameters()))
            assert not flat and program.decisions["foreach-update"].startswith(f"{count} parameters")


@BITWISE
def test_zero3_slices_are_views_of_one_flat_shard_per_unit_which_its_gathers_send():
    """After a step each gather unit's parameter slices are views of one buffer, this rank's flat shard (at W=1
    the whole unit), edits inside ``gathered()`` land in it, and the steps stay eager's bits; a whole tensor
    assigned between steps is refused, naming ``gathered()``; every all-gather sends a flat shard as it is, in a
    world of one and on each rank at W=2."""
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = transpile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ZeRO(stage=3, bucket_cap_mb="layer"), LOSS)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        batch = make_batch("mlp", 8, gen)
        step(*batch)
        eager_step(reference, ref_opt, LOSS, batch)
        if i == 1:
            with step.gathered() as whole, torch.no_grad():
                whole.net[0].weight.mul_(0.5)
            with torch.no_grad():
                reference.net[0].weight.mul_(0.5)
    units = step.program.param_buckets
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(units) > 1 and len(storages) == len(units)
    with step.gathered():
        for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(ours, theirs), name
    model.net[0].weight.data = reference.net[0].weight.detach().clone()
    with pytest.raises(ConfigurationError, match="under zero3 the model holds this rank's 1-D slice.*step.gathered"):
        step(*batch)
    for program in _world_programs("zero3", 1) + _world_programs("zero3", 2):
        sends = [n.args[0] for n in program.graph.nodes if n.meta.get("collective", {}).get("kind") == "all_gather"]
        assert sends and all(s.op == "placeholder" and s.meta["port"].kind == "flat" for s in sends), sends


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_lamb_norms_are_one_all_reduce_on_every_rank(mode):
    """LAMB's per-tensor norms at W=4: every rank's program sums the slices' norms with one all-reduce for all
    of them, and no update reads a norm before it (at W=1 it is eager: test_world_of_one_is_eager)."""
    for program in _world_programs(mode, 4, optimizer=Lamb):
        norms = [n for n in program.graph.nodes if "norm" in n.meta.get("collective", {})]
        assert len(norms) == 1 and len(norms[0].meta["collective"]["norm"]) == 2 * len(program.shards)
        wait = next(iter(norms[0].users))
        order = {n: i for i, n in enumerate(program.graph.nodes)}
        updates = [u for u in program.graph.nodes if u.target is torch.ops.aten.select.int and u.args[0] in wait.users]
        assert updates and all(order[u] > order[wait] for u in updates)


@BITWISE
def test_world_of_one_with_clipping_is_eager_clip_grad_norm():
    """At world size 1 nothing is sliced for the norm: clip_grad_norm_'s bits, and its norm as the metric."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = transpile(
        model,
        optimizer,
        ZeRO(stage=2, clipping=Clipping(max_norm=0.3), loss_scaling=LossScaling(dynamic=False, init_scale=1024.0)),
        loss_fn=LOSS,
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = make_batch("mlp", 8, gen)
        step(*batch)
        ref_opt.zero_grad()
        LOSS(reference(batch[0]), batch[1]).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
        ref_opt.step()
        assert step.last_metrics["grad_norm"] == norm
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.quick
def test_a_sharded_update_must_be_gathered():
    """A pipeline spec with shard-optimizer and no gather-params is refused when it is built, not at step 1: at
    transpile(), before anything is traced, by the order check (the pipeline ends without whole parameters)."""
    model = MLP()
    with pytest.raises(PipelineSpecError, match="'shard-optimizer' takes that away.*gather-params"):
        transpile(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            PassPipeline(spec="scale-loss-grad,shard-optimizer"),
            loss_fn=LOSS,
            example_inputs=make_batch("mlp", 4, torch.Generator().manual_seed(0)),
        )


@pytest.mark.quick
def test_refusals_say_what_to_do():
    class Scalar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.temperature = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return self.lin(x) * self.temperature

    model = Scalar()
    with pytest.raises(UnsupportedOptimizerError, match="0-d"):
        transpile(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            "zero2",
            loss_fn=LOSS,
            example_inputs=(torch.randn(3, 4), torch.tensor([0, 1, 0])),
        )


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_flat_boxes_cover_exactly_the_flat_range_in_order(shape, data):
    """The boxes a checkpoint describes a rank's slice with are that slice: in flat order, each one a
    contiguous run, together exactly the elements [lo, hi)."""
    numel = math.prod(shape)
    lo = data.draw(st.integers(0, numel))
    hi = data.draw(st.integers(lo, numel))
    whole = torch.arange(numel).view(shape)
    seen, end = [], lo
    for offsets, sizes, start in flat_boxes(shape, lo, hi):
        assert start == end
        box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert box.reshape(-1).tolist() == list(range(start, start + box.numel()))
        seen += box.reshape(-1).tolist()
        end = start + box.numel()
    assert seen == list(range(lo, hi))


@BITWISE
def test_checkpoint_round_trip_in_one_process_and_across_modes(tmp_path):
    """World size 1, no process group: a zero2 checkpoint read back by zero2 (bitwise, then 2 more steps equal)
    and by fused_allreduce (the same parameters and state); a fused_allreduce checkpoint read by zero1."""
    gen = torch.Generator().manual_seed(3)
    data = [make_batch("tied", 8, gen) for _ in range(5)]

    def run(mode, load=None, steps=data[:3]):
        torch.manual_seed(0)
        model = TiedLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = transpile(model, optimizer, mode, loss_fn=LOSS)
        if load is not None:
            step.load_checkpoint(load)
        for batch in steps:
            step(*batch)
        return model, optimizer, step

    model, optimizer, step = run("zero2")
    step.save_checkpoint(tmp_path / "zero2")
    for batch in data[3:]:
        step(*batch)
    for mode in ("zero2", "fused_allreduce"):
        resumed, resumed_opt, _ = run(mode, tmp_path / "zero2", data[3:])
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters())), mode
        for p, q in zip(model.parameters(), resumed.parameters()):
            for key, value in optimizer.state[p].items():
                assert torch.equal(value.reshape(-1), resumed_opt.state[q][key].reshape(-1)), (mode, key)
    plain_model, plain_opt, plain = run("fused_allreduce")
    plain.save_checkpoint(tmp_path / "fused")
    for batch in data[3:]:
        plain(*batch)
    resumed, resumed_opt, _ = run("zero1", tmp_path / "fused", data[3:])  # the same two steps after the checkpoint
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), resumed.parameters(), strict=True))
    for p, q in zip(plain_model.parameters(), resumed.parameters(), strict=True):
        assert plain_opt.state[p].keys() == resumed_opt.state[q].keys()
        for key, value in plain_opt.state[p].items():
            assert torch.equal(value.reshape(-1), resumed_opt.state[q][key].reshape(-1)), ("zero1", key)


@pytest.mark.quick
def test_checkpoint_refusals_say_why(tmp_path):
    model = MLP()
    batch = make_batch("mlp", 4, torch.Generator().manual_seed(0))
    local = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "local_sgd", loss_fn=LOSS)
    local(*batch)
    with pytest.raises(CheckpointError, match="state_dict"):
        local.save_checkpoint(tmp_path / "local")
    model = MLP()
    accumulating = transpile(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeRO(stage=1, accumulation=Accumulation(steps=2)),
        loss_fn=LOSS,
    )
    accumulating(*batch)
    with pytest.raises(CheckpointError, match="accumulation cycle"):
        accumulating.save_checkpoint(tmp_path / "mid")
    accumulating(*batch)
    accumulating.save_checkpoint(tmp_path / "boundary")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        accumulating.load_checkpoint(tmp_path / "missing")
    other = transpile(model, torch.optim.Adam(model.parameters()), "zero1", loss_fn=LOSS)
    with pytest.raises(CheckpointError, match="SGD"):
        other.load_checkpoint(tmp_path / "boundary")
