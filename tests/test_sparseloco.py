"""SparseLoCo: on real processes (gloo over loopback, the worlds of 2 and 4 ranks test_diloco.py also uses, each
rank on its own data) against the authors' DiLoCo loop and SparseLoCo optimizer run eagerly for every replica
(tests/sparseloco_worker.py, bench/authors_sparse.py); in one process, the wire format, the verifier, the dump and
the errors.

Bitwise at W=2 and W=4 on the CPU: the authors' scatter_reduce mean adds the ranks' values in rank order there, as
the mode's scatter_add does one rank at a time, and the rest is the same arithmetic on one CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import authors_sparse
from bench.tiny_models import MLP, make_batch
from passes.sparse_pseudo_exchange import (
    Sparsity,
    decode_mean,
    index_bits,
    message_parts,
    pack_bits,
    part_bytes,
    select,
    unpack_bits,
)
from passes.sparse_tiles import Tiling, from_rows, tile_side, to_rows
from tests.diloco_worker import LOSS, H
from tests.helpers import COMPOSED, resumed_matches, trained
from tests.sparseloco_worker import DENSE, ROUNDS, SPARSE, AuthorsSparseLoCo
from tests.test_diloco_w1 import FACTORY
from tests.worlds import run_in_world
from transpiler import ConfigurationError, SparseLoCo, VerificationError, mode_config, transpile
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


def follows_the_authors(ranks: list[dict], case: str) -> None:
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
def test_every_replica_follows_the_authors_step_by_step(runs):
    """4 rounds of H=3, each rank its own replica."""
    _, ranks = runs
    follows_the_authors(ranks, "reference")
    first = ranks[0]["reference"]["errors"]
    others = [r["reference"]["errors"] for r in ranks[1:]]
    assert any(not torch.equal(first[n], o[n]) for o in others for n in first), "each replica keeps its own buffer"


@pytest.mark.bitwise
@pytest.mark.parametrize("runs", [4], indirect=True, ids=["world4"])
@pytest.mark.parametrize("case", ["reference_2d", "reference_2d_zero1"])
def test_two_replicas_of_two_ranks_follow_the_authors(runs, case):
    """W=4, ``replica_size=2``: each replica's two ranks all-reduce their gradients (or reduce-scatter them into
    ZeRO-1 shards of AdamW's state), SparseLoCo across the two replicas."""
    _, ranks = runs
    follows_the_authors(ranks, case)


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
    """One all-gather of every parameter's indices (bits for its tile), 2-bit codes, and a shift and 4 bin means
    per parameter."""
    world, ranks = runs
    sparsity = Sparsity(SPARSE["chunk_size"], SPARSE["topk"], True, SPARSE["quantization_bins"])
    for record in ranks:
        wire = record["wire"]
        tilings = [Tiling.of(shape, sparsity.chunk) for shape in wire["shapes"]]
        assert [t.sides for t in tilings] == [(8, 5), (8,), (8, 8), (8,), (5, 8), (5,)]
        sizes = [part_bytes(t.rows, t.width, sparsity.k(t.width), sparsity) for t in tilings]
        # net.0.weight: 16 tiles of 8 × 5, k = round(40·12/64) = 8 (7.5 rounds to even), 6-bit indices, 2-bit codes
        assert sparsity.k(40) == 8 and sizes[0] == (96, 32, 20)
        # the two weights of 8 × 5 tiles (16 and 4 tiles, k = 8) and the two biases of 32 (4 tiles of 8 each, k = 2)
        # go as two groups
        weights, biases = part_bytes(20, 40, 8, sparsity), part_bytes(8, 8, 2, sparsity)
        groups = [weights, biases, sizes[2], sizes[5]]
        expected = sum(index + values for index, values, _ in groups) + 20 * 6
        assert wire["collectives"] == [("_c10d_functional.all_gather_into_tensor.default", expected)]
        assert wire["parts"] == [{"indices": sum(s[0] for s in groups), "values": sum(s[1] for s in groups),
                                  "tables": 20 * 6}]  # fmt: skip
        assert wire["gathered"] == world * expected


def test_world1_is_the_authors_loop_with_one_replica():
    torch.manual_seed(0)
    model = MLP()
    paper = AuthorsSparseLoCo(model, 1, SPARSE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    step = transpile(model, optimizer, mode_config("sparseloco", sync_every=H, **SPARSE), LOSS)
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
    shape=st.sampled_from([(32, 20), (64, 64), (12, 7), (97,), (10,), (3, 4, 5)]),
    chunk=st.sampled_from([4, 8, 64]),
    share=st.floats(0.01, 1.0),
    bins=st.sampled_from([0, 2, 4, 16]),
    world=st.integers(1, 4),
    dct=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_exchange_is_the_authors(shape, chunk, share, bins, world, dct, seed):
    """Tiles, top-k, quantiser, the message and the mean over the ranks that chose each entry, against the
    exchange written from the authors' code: what each rank keeps and the aggregate, bitwise; the message's length
    is :func:`part_bytes`'s. A tensor of three dimensions is cut as ``[shape[0], the rest]`` (the authors' code
    takes none), so the reference gets that matrix."""
    gen = torch.Generator().manual_seed(seed)
    matrix = (shape[0], math.prod(shape[1:])) if len(shape) > 2 else shape
    topk = max(1, round(share * chunk**2)) if not dct else max(1, round(share * chunk))
    buffers = [torch.randn(matrix, generator=gen) * 10.0 ** torch.randint(-3, 3, (), generator=gen).item()
               for _ in range(world)]  # fmt: skip
    kept_ref, total_ref = authors_sparse.exchange(buffers, chunk, topk, not dct, bins, 6, dct)
    sparsity = Sparsity(chunk, topk, not dct, bins, 6.0)
    tiling = Tiling.of(shape, chunk)
    forward, inverse = zip(*[authors_sparse_bases(s) for s in tiling.sides]) if dct else ((), ())
    k = sparsity.k(tiling.width)
    messages = []
    for e, theirs in zip(buffers, kept_ref):
        chosen = select([to_rows(e.reshape(shape), tiling.matrix, tiling.sides, *forward)], (k,), sparsity)
        assert chosen[0].numel() == sum(part_bytes(tiling.rows, tiling.width, k, sparsity))
        mine = e.reshape(shape) - from_rows(chosen[1], tiling.shape, tiling.matrix, tiling.sides, *inverse)
        assert torch.equal(mine.reshape(matrix), theirs)
        messages.append(chosen[0])
    (mean,) = decode_mean(torch.stack(messages), ((tiling.rows, tiling.width, k),), sparsity)
    total = from_rows(mean, tiling.shape, tiling.matrix, tiling.sides, *inverse)
    assert torch.equal(total.reshape(matrix), total_ref)
    assert index_bits(tiling.width) == max(1, math.ceil(math.log2(tiling.width)))


@pytest.mark.quick
@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.sampled_from([(32, 20), (16, 40), (20,), (40,), (8, 8, 5), (12, 7)]), min_size=2, max_size=5),
    bins=st.sampled_from([0, 4, 16]),
    world=st.integers(1, 3),
    dct=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parameters_exchanged_together_get_the_bits_each_gets_alone(shapes, bins, world, dct, seed):
    """Parameters whose tiles share a width and k take one top-k, packing and scatter together (their rows one
    after another in the group's outputs): what each rank keeps and the mean are, per parameter, the bits that
    parameter's exchange alone gives (itself the authors', above), quantiser per tensor included; the message
    is each group's indices and values, then each parameter's table. Cost: about 2 s."""
    gen = torch.Generator().manual_seed(seed)
    chunk = 8
    sparsity = Sparsity(chunk, 5 if dct else 12, not dct, bins, 6.0)
    tilings = [Tiling.of(shape, chunk) for shape in shapes]
    forward = [[authors_sparse_bases(s)[0] for s in t.sides] if dct else [] for t in tilings]
    ks = tuple(sparsity.k(t.width) for t in tilings)
    buffers = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(world)]
    rows = [[to_rows(e, t.matrix, t.sides, *f) for e, t, f in zip(rank, tilings, forward)] for rank in buffers]
    together = [select(r, ks, sparsity) for r in rows]
    means = decode_mean(torch.stack([c[0] for c in together]), tuple((t.rows, t.width, k) for t, k in
                                                                    zip(tilings, ks)), sparsity)  # fmt: skip
    groups: dict[tuple[int, int], list[int]] = {}  # by tile width and k, in order of first appearance
    for i, (t, k) in enumerate(zip(tilings, ks)):
        groups.setdefault((t.width, k), []).append(i)
    groups = {key: sorted(members, key=lambda i: tilings[i].rows) for key, members in groups.items()}  # by rows
    place = {i: (g, sum(tilings[j].rows for j in members[: members.index(i)]))
             for g, members in enumerate(groups.values()) for i in members}  # fmt: skip
    sizes = [part_bytes(sum(tilings[i].rows for i in m), width, k, sparsity) for (width, k), m in groups.items()]
    table = part_bytes(1, 1, 1, sparsity)[2]
    assert together[0][0].numel() == sum(a + b for a, b, _ in sizes) + len(shapes) * table
    assert (
        message_parts(tuple((t.rows, t.width, k) for t, k in zip(tilings, ks)), sparsity)["tables"]
        == len(shapes) * table
    )
    for i, (t, k) in enumerate(zip(tilings, ks)):
        alone = [select([r[i]], (k,), sparsity) for r in rows]
        (mean,) = decode_mean(torch.stack([c[0] for c in alone]), ((t.rows, t.width, k),), sparsity)
        g, first = place[i]
        assert torch.equal(means[g][first : first + t.rows], mean)
        for mine, theirs in zip(together, alone):
            assert torch.equal(mine[1 + g][first : first + t.rows], theirs[1])


def authors_sparse_bases(side: int) -> tuple[torch.Tensor, torch.Tensor]:
    eye = torch.eye(side)
    return authors_sparse.fft_dct(eye, False), authors_sparse.fft_dct(eye, True)


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), chunk=st.integers(1, 300))
def test_a_tile_side_is_the_authors_split(n, chunk):
    assert tile_side(n, chunk) == authors_sparse.smaller_split(n, chunk)


@pytest.mark.quick
def test_the_verifier_refuses_an_error_buffer_that_leaves_its_rank():
    model = MLP()
    config = SparseLoCo(sync_every=1, chunk_size=8, topk=2)
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), config, LOSS)
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
    assert "diloco-outer-step{topk=128,quantization-bins=4,error-decay=0.95}," in capsys.readouterr().out
    assert cli_main(["dump", FACTORY, "--mode", "sparseloco", "-O", "topk=8", "--variant", "sync"]) == 0
    out = capsys.readouterr().out
    for shown in ("x_error_feedback_2_bias], 0.95)", "sparse_tiles_to_rows", "transpiler.sparse_select",
                  "all_gather_into_tensor", "transpiler.sparse_decode_mean"):  # fmt: skip
        assert shown in out
    assert "all_reduce" not in out


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, outer, match",
    [
        ({"quantization_bins": 300}, False, "2 to 256 bins"),
        ({"topk": 20, "chunk_size": 4}, False, "topk <= chunk_size²"),
        ({"topk": 0}, False, "topk"),
        ({}, True, "takes no outer_optimizer"),
    ],
)
def test_clear_errors(options, outer, match):
    model = MLP()
    kwargs = {"outer_optimizer": torch.optim.SGD(model.parameters(), lr=1.0)} if outer else {}
    with pytest.raises(ConfigurationError, match=match):
        transpile(
            model, torch.optim.SGD(model.parameters(), lr=0.1), mode_config("sparseloco", **options), LOSS, **kwargs
        )


@pytest.mark.quick
def test_the_sparse_exchange_does_not_combine_with_streaming_options():
    with pytest.raises(ConfigurationError, match="does not combine with fragments"):
        from transpiler import PassPipeline

        PassPipeline(spec="diloco-outer-step{topk=4,fragments=2}")


@pytest.mark.bitwise
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_accumulation_clipping_and_autocast_compose_as_in_diloco(autocast):
    """Dense SparseLoCo (the identity above) with accumulation and clipping, with and without bfloat16 autocast,
    is DiLoCo with outer SGD under the same composition, which test_diloco_w1.py holds to the eager loop."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    def outer(params):
        return torch.optim.SGD(params, lr=1.0)

    sparse = trained("sparseloco", {"sync_every": H, **DENSE, **COMPOSED}, adamw, autocast=autocast)
    diloco = trained("diloco", {"sync_every": H, **COMPOSED}, adamw, outer, autocast=autocast)
    for a, b in zip(sparse, diloco):
        assert torch.equal(a, b)


@pytest.mark.bitwise
def test_a_world1_dcp_checkpoint_mid_round_resumes_bitwise(tmp_path):
    """The error buffers are saved per rank, beside θ_global and the outer state."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    options = {"sync_every": H, "chunk_size": 8, "topk": 12}
    assert all(same for _, same in resumed_matches("sparseloco", options, adamw, tmp_path, "dcp"))
