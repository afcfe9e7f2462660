"""SparseLoCo: on real processes (gloo over loopback, the worlds of 2 and 4 ranks test_diloco.py also uses, each
rank on its own data) against the paper's loop run eagerly for every replica (tests/sparseloco_worker.py); in one
process, the wire format, the verifier, the dump and the errors.

Bitwise at W=2 and W=4: every rank adds the decoded messages in rank order, as the reference does, and the rest is
the same arithmetic on one CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.sparse_pseudo_exchange import decode_sum, index_bits, message_bytes, pack_bits, select, unpack_bits
from tests.diloco_worker import LOSS, H
from tests.helpers import COMPOSED, resumed_matches, trained
from tests.models import MLP, make_batch
from tests.sparseloco_worker import ROUNDS, SPARSE, PaperSparseLoCo, compress
from tests.test_diloco_w1 import FACTORY
from tests.worlds import run_in_world
from transpiler import ConfigurationError, VerificationError, transpile
from transpiler.cli import main as cli_main
from transpiler.graph.verify import check_private_state_stays


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_in_world(world, "tests.sparseloco_worker:checks", tmp_path_factory.mktemp(f"sparseloco{world}"))


W2 = pytest.mark.parametrize("runs", [2], indirect=True, ids=["world2"])


def same(a: dict, b: dict) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: {(a[name] - b[name]).abs().max().item():.3g}"


def follows_the_paper(ranks: list[dict], case: str) -> None:
    """Every rank's replica, θ_global and error buffers equal the reference's after every step, bitwise."""
    for record in ranks:
        run = record[case]
        assert run["variants"] == (["inner"] * (H - 1) + ["sync"]) * ROUNDS
        for t in range(len(run["variants"])):
            same(run["replica"][t], run["paper"][t])
            same(run["global"][t], run["paper_global"][t])
        same(run["errors"], run["paper_errors"])
        assert all(e.abs().sum() > 0 for e in run["errors"].values()), "most of each Δ stays in the buffer"


@pytest.mark.bitwise
def test_every_replica_follows_the_paper_step_by_step(runs):
    """4 rounds of H=3, each rank its own replica."""
    _, ranks = runs
    follows_the_paper(ranks, "reference")
    first = ranks[0]["reference"]["errors"]
    others = [r["reference"]["errors"] for r in ranks[1:]]
    assert any(not torch.equal(first[n], o[n]) for o in others for n in first), "each replica keeps its own buffer"


@pytest.mark.bitwise
@pytest.mark.parametrize("runs", [4], indirect=True, ids=["world4"])
@pytest.mark.parametrize("case", ["reference_2d", "reference_2d_zero1"])
def test_two_replicas_of_two_ranks_follow_the_paper(runs, case):
    """W=4, ``replica_size=2``: each replica's two ranks all-reduce their gradients (or reduce-scatter them into
    ZeRO-1 shards of AdamW's state), SparseLoCo across the two replicas."""
    _, ranks = runs
    follows_the_paper(ranks, case)


@pytest.mark.bitwise
@W2  # at W=4 DiLoCo's all-reduce sums four Δ in gloo's order, SparseLoCo in rank order
def test_dense_sparseloco_is_diloco_with_outer_sgd(runs):
    """k = chunk, 32-bit values, β = 0: every Δ is sent whole and nothing stays, so the mean is DiLoCo's."""
    _, ranks = runs
    for record in ranks:
        runs_ = record["identity"]
        for (va, a), (vb, b) in zip(runs_["sparseloco"], runs_["diloco"]):
            assert va == vb
            same(a, b)


@pytest.mark.bitwise
@W2
def test_state_dict_mid_round_carries_the_error_buffers(runs):
    _, ranks = runs
    for record in ranks:
        run = record["resume"]
        assert run["saved_errors"] and all(e.abs().sum() > 0 for e in run["saved_errors"].values())
        straight = run["straight"][-len(run["resumed"]) :]
        for a, b in zip(straight, run["resumed"]):
            same(a, b)


def test_only_the_message_is_sent_and_its_bytes_are_the_formula(runs):
    world, ranks = runs
    for record in ranks:
        wire = record["wire"]
        rows, k, chunk = wire["rows"], SPARSE["topk"], SPARSE["chunk_size"]
        expected = sum(message_bytes(rows, k, chunk, SPARSE["value_bits"]))
        # indices 4 bits, values 2 bits, each part padded to a multiple of 4 bytes; a float32 scale per chunk
        assert expected == 4 * math.ceil(rows * k * 4 / 32) + 4 * math.ceil(rows * k * 2 / 32) + 4 * rows
        assert wire["collectives"] == [("_c10d_functional.all_gather_into_tensor.default", expected)]
        assert wire["gathered"] == world * expected


def test_world1_is_the_papers_loop_with_one_replica():
    torch.manual_seed(0)
    model = MLP()
    s = SPARSE
    paper = PaperSparseLoCo(model, 1, s["chunk_size"], s["topk"], s["value_bits"], s["error_decay"], s["outer_lr"])
    step = transpile(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01), "sparseloco", LOSS,
                     sync_every=H, **SPARSE)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    for _ in range(2 * H):
        x, y = make_batch("mlp", 8, gen)
        step(x, y)
        paper.step([(x, y)])
        for a, b in zip(model.parameters(), paper.replicas[0].parameters()):
            assert torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), values=st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=40))
def test_bit_packing_round_trips_and_is_little_endian(bits, values):
    codes = torch.tensor([v % 2**bits for v in values])
    packed = pack_bits(codes, bits)
    assert packed.numel() == math.ceil(len(values) * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, len(values)), codes)
    as_int = sum(int(c) << (bits * i) for i, c in enumerate(codes))  # bit j of the stream: bit j % b of code j // b
    assert packed.tolist() == [(as_int >> (8 * i)) & 255 for i in range(packed.numel())]


@pytest.mark.quick
@settings(max_examples=40, deadline=None)
@given(
    chunk=st.sampled_from([4, 16, 33, 64]),
    share=st.floats(0.01, 1.0),
    bits=st.sampled_from([2, 4, 8, 32]),
    world=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_the_message_decodes_to_what_the_compressor_keeps(chunk, share, bits, world, seed):
    """``select`` keeps exactly what the written-out compressor keeps, its message has the documented length,
    and ``decode_sum`` of W messages is their decoded values added in rank order."""
    k = max(1, round(share * chunk))
    gen = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(3, chunk, generator=gen) * 10.0 ** torch.randint(-3, 3, (3, 1), generator=gen)
               for _ in range(world)]  # fmt: skip
    messages, total = [], torch.zeros(3, chunk)
    for e in buffers:
        message, sent = select(e, k, bits)
        assert torch.equal(sent, compress(e, chunk, k, bits))
        assert message.numel() == sum(message_bytes(3, k, chunk, bits))
        messages.append(message)
        total = total + sent
    assert torch.equal(decode_sum(torch.stack(messages), 3, k, chunk, bits), total)
    assert index_bits(chunk) == max(1, math.ceil(math.log2(chunk)))


@pytest.mark.quick
def test_the_verifier_refuses_an_error_buffer_that_leaves_its_rank():
    model = MLP()
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "sparseloco", LOSS, sync_every=1,
                     chunk_size=16, topk=2)  # fmt: skip
    step(*make_batch("mlp", 8, torch.Generator().manual_seed(0)))
    program = step.programs["sync"]
    check_private_state_stays(program, True)
    gather = next(n for n in program.graph.nodes if "collective" in n.meta)
    message = gather.args[0]
    message.meta.pop("sent")  # the message no longer marks where the buffer's own values stop
    with pytest.raises(VerificationError, match="error_feedback.*never leaves its rank"):
        check_private_state_stays(program, True)


@pytest.mark.quick
def test_modes_and_dump_show_the_sparse_exchange(capsys):
    assert cli_main(["modes"]) == 0
    assert "sync: broadcast-params,diloco-outer-step{topk=64,value-bits=2,error-decay=0.95}," in capsys.readouterr().out
    assert cli_main(["dump", FACTORY, "--mode", "sparseloco", "-O", "topk=8", "--variant", "sync"]) == 0
    out = capsys.readouterr().out
    for shown in ("x_error_feedback_0_weight, 0.95", "sparse_pseudo_exchange_select(cat_default, 8, 2)",
                  "all_gather_into_tensor", "sparse_pseudo_exchange_decode_sum"):  # fmt: skip
        assert shown in out
    assert "all_reduce" not in out


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, outer, match",
    [
        ({"value_bits": 3}, False, "2, 4, 8 or 32 bits"),
        ({"topk": 20, "chunk_size": 16}, False, "topk <= chunk"),
        ({"topk": 0}, False, "topk"),
        ({}, True, "takes no outer_optimizer"),
    ],
)
def test_clear_errors(options, outer, match):
    model = MLP()
    kwargs = {"outer_optimizer": torch.optim.SGD(model.parameters(), lr=1.0)} if outer else {}
    with pytest.raises(ConfigurationError, match=match):
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "sparseloco", LOSS, **options, **kwargs)


@pytest.mark.quick
def test_the_sparse_exchange_does_not_combine_with_streaming_options():
    with pytest.raises(ConfigurationError, match="does not combine with fragments"):
        from transpiler.strategies.modes import build_strategy

        build_strategy("diloco-outer-step{topk=4,fragments=2}", {})


@pytest.mark.bitwise
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_accumulation_clipping_and_autocast_compose_as_in_diloco(autocast):
    """Dense SparseLoCo (the identity above) with accumulation and clipping, with and without bfloat16 autocast,
    is DiLoCo with outer SGD under the same composition, which test_diloco_w1.py holds to the eager loop."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    def outer(params):
        return torch.optim.SGD(params, lr=0.8)

    dense = {"chunk_size": 16, "topk": 16, "value_bits": 32, "error_decay": 0.0, "outer_lr": 0.8}
    sparse = trained("sparseloco", {"sync_every": H, **dense, **COMPOSED}, adamw, autocast=autocast)
    diloco = trained("diloco", {"sync_every": H, **COMPOSED}, adamw, outer, autocast=autocast)
    for a, b in zip(sparse, diloco):
        assert torch.equal(a, b)


@pytest.mark.bitwise
def test_a_world1_dcp_checkpoint_mid_round_resumes_bitwise(tmp_path):
    """The error buffers are saved per rank, beside θ_global and the outer state."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    options = {"sync_every": H, "chunk_size": 16, "topk": 3}
    assert all(same for _, same in resumed_matches("sparseloco", options, adamw, tmp_path, "dcp"))
