"""ZeRO-1, ZeRO-2 and ZeRO-3 (``zero1``, ``zero2``, ``zero3``) against DDP and single-process training, in real
worlds of 2 and 4.

One world per size runs every scenario (tests/zero_worker.py): the tests' tied-embedding model, an MLP and a
tiny Hugging Face GPT-2 (no dropout), with SGD with momentum, AdamW (twins), RMSprop, Adagrad and NAdam (the
generic path) and the tests' Lion and LAMB (users' optimizers), with gradient accumulation in each mode, 5 steps
each. Under zero3 the parameters are compared inside
``step.gathered()`` (which the test so uses every step), one scenario without ``reshard_after_forward``; the
forward and backward read all-gathered copies of the parameters, whose values are the same bits.

Where parity is bitwise, and why:
* against DDP at world size 2: the loss-gradient seed is scaled by 1/2 (exact), a sum of two values does not
  depend on the order gloo adds them, and the update runs the same element-wise ops on slices that eager runs
  on whole tensors: each element's result does not depend on where it sits (checked on this CPU for the ops
  the optimizers use, docs/strategies/zero.md). Parameters, and this rank's slices of the optimizer state, are
  compared with torch.equal after every step.
* at world size 4 gloo's ring sums each element in an order that depends on its place in the buffer, and our
  buckets are not DDP's: the last bit of a gradient may differ, and AdamW divides it by the square root of a
  second moment that is tiny for rarely seen embedding rows, so the parameters may move by up to 1e-5 (2.2e-6
  measured on GPT-2).
* zero2/zero3 with accumulation reduce-scatter every micro-step and add the reduced slices (DeepSpeed's
  stage 2); DDP's ``no_sync`` adds each rank's micro-steps and reduces once. The same terms in another order:
  within 1e-5. zero1 accumulates whole gradients as DDP does: bitwise at W=2.
* LAMB (a test optimizer from the paper's formula) takes each tensor's norm: under a sharded optimizer the
  slices' norms summed over the ranks by one all-reduce, in another order than the whole tensor's: within 1e-5.
* against one process on the whole batch: the mean of per-shard means rounds differently: within 1e-5.
* where DDP itself is further than that from one process on the whole batch (NAdam on GPT-2 at W=4: 6.6e-5 by
  step 3, its early steps divide by a tiny second moment as AdamW's do, with a larger step), the bound is twice
  DDP's own distance, measured in the same run: a sum in another order moves these parameters that far.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.checkpoint_worker import STAGES
from tests.worlds import run_in_world
from tests.zero_worker import SCENARIOS
from transpiler.graph.bucket_layout import SLOT_ALIGN_BYTES

# The first test to ask for ``runs`` waits for a world's whole job (131-178 s on a loaded 2-core machine on
# 2026-11-26, over 240 s under a profiler), and the first to ask for ``dcp_worlds`` for four jobs: the limits
# are twice what they take.
pytestmark = [pytest.mark.bitwise, pytest.mark.timeout(600)]
ATOL_W4, ATOL_SINGLE = 1e-5, 1e-5  # the sums in another order (W=4, sharded accumulation, LAMB's norms)
ATOL_COMPILED = 1e-7  # Inductor fuses the update's arithmetic: README and docs/strategies/zero.md, 1.5e-8 measured


@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=pytest.mark.within_tolerance)], ids=lambda w: f"world{w}"
)
def runs(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"zero{world}")
    return world, run_in_world(world, "tests.zero_worker:capturing_checks", out, timeout=480)  # below the tests' limit


@pytest.fixture(scope="module")
def dcp_worlds(tmp_path_factory) -> dict[str, list[dict]]:
    """The checkpoint worlds in the order the checks need (tests/checkpoint_worker.py's STAGES): W=2 writes a
    zero2 checkpoint, W=4 reads it and writes a zero3 one, W=3 reads that and writes its own, a second W=2
    reads W=3's. One fixture, so that no test depends on another having run first."""
    checkpoints = tmp_path_factory.mktemp("dcp")
    worlds = {}
    for stage, (world, *_) in STAGES.items():
        out = tmp_path_factory.mktemp(f"dcp_{stage}")
        worlds[stage] = run_in_world(world, "tests.checkpoint_worker:dcp_checkpoints", out, (checkpoints, stage))
    return worlds


def whole_from_slices(records: list[dict]) -> dict[str, torch.Tensor]:
    """The whole optimizer state that a world's ranks hold in slices (each record's ``params``, ``state`` and
    ``shards``), by ``param.key``."""
    params = records[0]["params"]
    whole: dict[str, torch.Tensor] = {}
    for record in records:
        for key, value in record["state"].items():
            name = key.rsplit(".", 1)[0]
            if value.dim() == 0:
                whole[key] = value
                continue
            lo, hi = record["shards"][name]
            flat = whole.setdefault(key, torch.full(params[name].shape, float("nan"), dtype=value.dtype)).view(-1)
            flat[lo:hi] = value.reshape(-1)
    return whole


def test_dcp_resume_at_the_same_world_size_is_bitwise(dcp_worlds):
    """save_checkpoint after 3 steps, 2 more; a fresh model, optimizer and step (other weights) read it back
    with load_checkpoint and take the same 2 steps: the same bits (zero1 and zero2 at W=2; zero3 at W=4, its
    parameters sharded too; and zero1 with two micro-steps per update, whose first variant holds no slices)."""
    checked = set()
    for stage, ranks in dcp_worlds.items():
        for rank, results in enumerate(ranks):
            for mode, resumed in results["resume"].items():
                assert resumed["params"][0] and resumed["state"][0], (stage, rank, mode, resumed)
                checked.add((len(ranks), mode))
    assert checked == {(2, "zero1"), (2, "zero2"), (2, "zero1+accumulate"), (4, "zero3")}


@pytest.mark.parametrize(
    "reader,writer", [("w4", "w2"), ("w3", "w4"), ("w2_from_w3", "w3")], ids=["2to4", "4to3", "3to2"]
)
def test_dcp_checkpoint_reads_at_another_world_size_and_trains_as_ddp(dcp_worlds, reader, writer):
    """A checkpoint written at one world size, read at another (W=2's zero2 at W=4; W=4's zero3 at W=3, an odd
    size whose shards are uneven; W=3's at W=2), into zero3 built before loading (each rank reads its slices of
    the parameters and the state) and into zero1 not built (whole tensors, cut at the first step). The
    parameters, and the optimizer state reassembled from the reader's slices, are the saved ones, bitwise. The
    next 2 steps follow DDP loaded from the same checkpoint through get_state_dict/dcp.load/set_state_dict:
    bitwise at W=2; within ATOL_W4 at W=3 and W=4, where gloo's ring sums each element in an order that depends
    on its place in the bucket (as in test_parity_with_ddp_and_single_process; 1.9e-9 at W=4 and 6e-8 at W=3
    measured)."""
    ranks, writers = dcp_worlds[reader], dcp_worlds[writer]
    exact = len(ranks) == 2
    saved = writers[0]["saved"]["params"]
    saved_state = whole_from_slices([r["saved"] for r in writers])
    for entry in ("built", "unbuilt"):
        for rank, results in enumerate(ranks):
            record = results["reshard"][entry]
            loaded = record["loaded"]["params"]
            assert loaded.keys() == saved.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved), (entry, rank)
            assert len(record["trained"]) == 2, entry
            for step, (params, state) in enumerate(record["trained"]):
                if exact:
                    assert params[0] and state[0], (entry, rank, step, params, state)
                else:
                    assert params[1] <= ATOL_W4 and state[1] <= ATOL_W4, (entry, rank, step, params, state)
        if entry == "built":  # the unbuilt step holds whole tensors until its first step
            state = whole_from_slices([r["reshard"][entry]["loaded"] for r in ranks])
            assert state.keys() == saved_state.keys()
            assert all(torch.equal(state[k], saved_state[k]) for k in state), entry


@pytest.mark.parametrize("writer", ["w4", "w3"], ids=["4to1", "3to1"])
def test_dcp_checkpoint_reads_into_a_plain_model(dcp_worlds, writer):
    """One process, no process group: a plain TiedLM and AdamW read a zero3 checkpoint of W=4 or W=3 (uneven
    slices) with torch's own get_state_dict/dcp.load/set_state_dict, and hold the saved parameters and the
    whole optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from bench.tiny_models import TiedLM

    writers = dcp_worlds[writer]
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    msd, osd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=writers[0]["path"])
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    saved = writers[0]["saved"]["params"]
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    expected = whole_from_slices([r["saved"] for r in writers])
    names = {p: n for n, p in model.named_parameters()}
    assert {f"{names[p]}.{k}" for p, entries in optimizer.state.items() for k in entries} == expected.keys()
    for p, entries in optimizer.state.items():
        for key, value in entries.items():
            assert torch.equal(value, expected[f"{names[p]}.{key}"]), (names[p], key)


def test_a_zero3_checkpoint_saved_before_the_first_step_holds_rank_0s_weights(dcp_worlds):
    """W=2, each rank's model initialised differently, ``save_checkpoint`` before any step: it runs the startup first
    (rank 0's weights broadcast, as the first step would), so a plain model reads rank 0's initial weights from it,
    and the step that follows runs (before the startup ran first, it failed in gloo) and leaves the ranks alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from bench.tiny_models import TiedLM

    first = [r["first"] for r in dcp_worlds["w2"]]
    rank0 = first[0]["rank0"]
    assert all(torch.equal(first[0]["mine"][n], rank0[n]) for n in rank0)
    assert not all(torch.equal(first[1]["mine"][n], rank0[n]) for n in rank0)  # rank 1 started elsewhere
    model = TiedLM()
    msd = get_model_state_dict(model)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": msd}, checkpoint_id=first[0]["path"])
    set_model_state_dict(model, msd)
    assert all(torch.equal(p, rank0[n]) for n, p in model.named_parameters())
    assert all(torch.equal(first[0]["after"][n], first[1]["after"][n]) for n in rank0)


def test_dcp_refuses_a_mode_that_keeps_ranks_apart_and_the_world_goes_on(dcp_worlds):
    """local_sgd at W=2: save_checkpoint raises CheckpointError on every rank, saying why and what to do
    instead, before any collective: an all-reduce afterwards still sums both ranks."""
    for rank, results in enumerate(dcp_worlds["w2"]):
        refusal = results["refuses"]["refusal"]
        assert "keeps ranks apart" in refusal and "state_dict()" in refusal, (rank, refusal)
        assert results["refuses"]["after"] == 2.0, rank


def _scenarios(world: int) -> list[str]:
    return [",".join(map(str, s)) for s in SCENARIOS[world]]


def sums_in_another_order(name: str) -> bool:
    """zero2/zero3 with accumulation: each micro-step's gradients are reduce-scattered and summed into this
    rank's accumulator slices, where DDP's ``no_sync`` sums each rank's micro-steps and then all-reduces once.
    LAMB: each tensor's norm is summed from the slices' norms. The same terms added in another order."""
    _, optimizer, mode, steps, *_ = name.split(",")
    return mode in ("zero2", "zero3") and int(steps) > 1 or optimizer == "lamb"


def test_parity_with_ddp_and_single_process(runs):
    """Bitwise at W=2 (within 1e-5 where the sums run in another order: W=4, sharded accumulation, LAMB's
    norms)."""
    world, ranks = runs
    check_parity(world, ranks, _scenarios(world))


def check_parity(world: int, ranks: list[dict], names: list[str]) -> None:
    """Each scenario of ``names`` against DDP and one process, every rank, every step (the test above)."""
    for name in names:
        spread = 2 * max(ranks[0][name]["ddp_single"])  # how far a sum in another order moves DDP itself
        atol, atol_single = max(ATOL_W4, spread), max(ATOL_SINGLE, spread)
        for rank, results in enumerate(ranks):
            record = results[name]
            for step, (params, state) in enumerate(zip(record["params"], record["state"])):
                where = f"{name} rank {rank} step {step}"
                if world == 2 and not sums_in_another_order(name):
                    assert params[0], f"{where}: parameters differ from DDP by {params[1]}"
                    assert state[0], f"{where}: optimizer-state slices differ from DDP's by {state[1]}"
                else:
                    assert params[1] <= atol and state[1] <= atol, f"{where}: {params[1]}, {state[1]}"
        assert max(ranks[0][name]["single"]) <= atol_single, f"{name}: {ranks[0][name]['single']}"
        finals = [r[name]["final"] for r in ranks]
        for other in finals[1:]:  # every rank ends with the same whole parameters
            assert all(torch.equal(finals[0][k], other[k]) for k in finals[0]), name


def test_zero3_follows_fsdp2_on_gpt2(runs):
    """Against FSDP2 wrapped as torchtitan wraps a model (every block, then the root; foreach AdamW), 5 steps on
    GPT-2, ``zero3`` with its defaults. W=2: the same bits every step (FSDP2 halves each gradient before summing
    two values; both are exact). W=4: gloo sums four values in an order set by the buffer, and FSDP2 wrapped at
    the root alone keeps FSDP2's bits (measured: 0 apart), so FSDP2's own spread under another bucketing is no
    bound. The bound is twice DDP's distance from FSDP2 in the same run (DDP 1.2e-6, zero3 2.1e-6 measured by
    step 5)."""
    world, ranks = runs
    for rank, results in enumerate(ranks):
        record = results["fsdp2"]
        assert all(same for same, _ in record["root_only"]), (rank, record["root_only"])
        if world == 2:
            assert all(same for same, _ in record["zero3"]), (rank, record["zero3"])
        else:
            spread = 2 * max(gap for _, gap in record["ddp"])
            assert max(gap for _, gap in record["zero3"]) <= spread, (rank, record["zero3"], record["ddp"])
        assert record["decision"].startswith("bucket_cap_mb=cost"), record["decision"]


def test_every_element_is_updated_by_exactly_one_rank(runs):
    world, ranks = runs
    for name in _scenarios(world):
        shards = [r[name]["shards"] for r in ranks]
        for param in shards[0]:
            owned = sorted(s[param] for s in shards if s[param][1] > s[param][0])
            assert all(a[1] == b[0] for a, b in zip(owned, owned[1:])), (name, param, owned)
            assert owned[0][0] == 0
        kinds = ranks[0][name]["kinds"]
        gathers, scatters = kinds.count("all_gather"), kinds.count("reduce_scatter")
        norms = {"all_reduce"} if ",lamb," in name else set()  # one all-reduce of the slices' norms
        assert set(kinds) == {"reduce_scatter", "all_gather"} | norms and kinds.count("all_reduce") == len(norms), kinds
        if ",zero3," in name:  # each bucket gathered for the forward, and again for the backward where it is read
            assert scatters <= gathers <= 2 * scatters, (name, kinds)
        else:  # the updated slices gathered once
            assert gathers == scatters, (name, kinds)


def test_zero3_default_units_are_sized_on_the_measured_cost_alike_on_every_rank(runs):
    """``bucket_cap_mb="cost"`` (zero3's default): the ranks measure what an all-gather costs, agree on it, and
    cut the same gather units; on the CPU, where every all-gather runs alone, units fill to the bound
    (test_zero_static checks how the units follow the cost; their parity with DDP is
    test_parity_with_ddp_and_single_process's)."""
    world, ranks = runs
    names = [name for name in _scenarios(world) if "'cost'" in name]
    assert names
    for name in names:
        decision = ranks[0][name]["decisions"]["shard-optimizer"]
        assert decision.startswith("bucket_cap_mb=cost: ") and "nothing runs behind it" in decision, decision
        assert all(r[name]["decisions"]["shard-optimizer"] == decision for r in ranks[1:]), name


def test_memory_report_counts_the_held_tensors(runs):
    """Optimizer state per rank: DDP's / W plus padding; zero2 and zero3 hold no gradients between steps (with
    accumulation: their sharded accumulators, which add up over the ranks to the model's gradients), zero1
    its persistent buckets; parameters whole on every rank, except under zero3: there the ranks' slices add up
    to the model, plus the padding that each rank's flat shard holds (slots start aligned, as in the gradient
    buckets the update runs over, and so do the ranks' shards: at most SLOT_ALIGN_BYTES a parameter and a shard);
    a peak above what is held."""
    world, ranks = runs
    for name in _scenarios(world):
        sharded_accumulators = sums_in_another_order(name) and ",lamb," not in name
        if sharded_accumulators:
            model, held = ranks[0][name]["model_bytes"], sum(r[name]["memory"]["gradients"] for r in ranks)
            assert 0 < held <= model, (name, held, model)
        total = sum(r[name]["memory"]["optimizer_state"] for r in ranks)
        ddp = ranks[0][name]["ddp_state_bytes"]
        zero_d_steps = total - ddp  # the 0-d step counts are whole on every rank, and padding is owned
        assert 0 <= zero_d_steps <= ddp * 0.2 + 4096 * world, (name, total, ddp)
        if ",zero3," in name:
            model, held = ranks[0][name]["model_bytes"], sum(r[name]["memory"]["parameters"] for r in ranks)
            # the tied model's frozen scale (64 bytes) is whole on every rank
            padding = SLOT_ALIGN_BYTES * (ranks[0][name]["model_tensors"] + world * ranks[0][name]["param_buckets"])
            assert model <= held <= model + 64 * (world - 1) + padding, (name, held, model)
        for r in ranks:
            memory = r[name]["memory"]
            if ",zero3," in name:
                assert memory["parameters"] < r[name]["model_bytes"], name
            if sharded_accumulators:
                assert memory["gradients"] < r[name]["model_bytes"], name
            elif ",zero2," in name or ",zero3," in name:
                assert memory["gradients"] == 0, name
            else:
                assert memory["gradients"] >= memory["parameters"] * 0.9, name
            assert memory["peak"] > memory["parameters"] + memory["gradients"] + memory["optimizer_state"], name


def test_loss_scaling_and_clipping_compose_with_shards(runs):
    """Against DDP with GradScaler (fp16 autocast, first scale 2**20: the first steps overflow and are skipped)
    and ``clip_grad_norm_``, 10 steps. Each rank sees only its slices: the overflow flag and the partial norms
    are all-reduced. Bitwise at W=2 with loss scaling alone and with the inf-norm (a max is exact); the 2-norm
    is summed per rank, then across ranks, so its last bits differ from clip_grad_norm_'s (relative 1e-6) and
    the parameters within 1e-5 (as at W=4)."""
    world, ranks = runs
    for name in ranks[0]["composed"]:
        _, _, _, scale, clip = name.split(",", 4)
        exact = world == 2 and (clip == "None" or "inf" in clip)
        for rank, results in enumerate(ranks):
            record = results["composed"][name]
            where = f"{name} rank {rank}"
            for step, (same, diff) in enumerate(record["params"]):
                assert same if exact else diff <= ATOL_W4, f"{where} step {step}: parameters differ from DDP by {diff}"
            for ours, theirs in record["norms"]:
                if not math.isfinite(theirs):  # an overflow step: skipped by both
                    assert not math.isfinite(ours), (where, ours, theirs)
                else:
                    assert ours == theirs if exact else abs(ours - theirs) <= 1e-6 * theirs, (where, ours, theirs)
            assert all(a == b for a, b in record["skipped"]), (where, record["skipped"])
            if scale == "True":
                assert any(a for a, _ in record["skipped"]) and not all(a for a, _ in record["skipped"]), where
            if clip != "None":
                assert any(theirs > float(clip.split(",")[0].strip("( ")) for _, theirs in record["norms"]), where


def test_captured_steps_follow_ddp_and_capture_once(runs):
    """``cuda_graph=True`` under the zero modes at W=2, the capture replayed by calling (a GPU's capture is
    tests/test_gpu.py): bitwise DDP in test_parity_with_ddp_and_single_process, and each program captured
    once over 5 steps, zero3's through ``gathered()`` every step (it puts the slices back where they were)."""
    world, ranks = runs
    captured = [name for name in _scenarios(world) if "cuda_graph" in name]
    if world != 2:
        pytest.skip("captured in the world of 2")
    assert len(captured) == 3
    for results in ranks:
        for name in captured:
            assert results[name]["captures"] == {"step": 1}, (name, results[name]["captures"])


def test_resume_is_bitwise(runs):
    _, ranks = runs
    for results in ranks:
        for mode, outcome in results["resume"].items():
            assert outcome["params"][0] and outcome["state"][0], (mode, outcome)


def test_whole_tensor_optimizers_are_refused_with_the_reason(runs):
    world, ranks = runs
    if world != 2:
        pytest.skip("checked in the world of 2")
    refusals = ranks[0]["refusals"]
    assert refusals["adafactor"].startswith("ConfigurationError") and "element-wise" in refusals["adafactor"]
    assert refusals["norm"].startswith("UnsupportedOptimizerError")
    assert "linalg_vector_norm" in refusals["norm"] and "fused_allreduce" in refusals["norm"]


def test_compiled_zero_follows_ddp_and_compiles_once(runs):
    """compile=True with zero1, zero2 and zero3 at W=2: AdamW with a LambdaLR scheduler over 8 steps compiles one
    graph
    (lr and Adam's step size reach it as 0-d tensors) and stays within 1e-7 of DDP (Inductor fuses the update's
    arithmetic, so not eager's exact operation order; 1.5e-8 measured). zero1's buckets are padded to W
    shards, which the compiled form's ``cat`` must keep (before, it dropped the padding and refused)."""
    world, ranks = runs
    if world != 2:
        pytest.skip("compiled in the world of 2")
    if "compiled" not in ranks[0]:
        pytest.skip("not under ATEN_CPU_CAPABILITY=default: Inductor's C++ does not build there (at::vec undeclared)")
    for rank, results in enumerate(ranks):
        for mode, record in results["compiled"].items():
            assert record["graphs"] == 1, (rank, mode, record["graphs"])
            assert max(record["params"]) <= ATOL_COMPILED, (rank, mode, record["params"])
            assert record["compile_seconds"]["step"] > 0
