"""DeMo: on real processes (gloo over loopback, the worlds of 2 and 4 ranks test_diloco.py also uses, each rank on
its own data) against the authors' DeMo optimizer run eagerly for every rank (tests/demo_worker.py); in one
process, the DCT bases against the authors' and scipy's, the wire format, the verifier, the dump and the errors.

Bitwise at W=2 and W=4 on the CPU: the authors' scatter_reduce mean adds the ranks' values in rank order there,
as the mode's scatter_add does one rank at a time, and each DCT is the same einsum with the same bases.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
import torch

from bench.authors_sparse import fft_dct
from bench.tiny_models import MLP, make_batch
from passes.sparse_pseudo_exchange import Sparsity, part_bytes
from passes.sparse_tiles import Tiling, dct_bases
from tests.demo_worker import DEMO, STEPS
from tests.diloco_worker import LOSS
from tests.helpers import COMPOSED, EXCHANGE_OPS, exchange_ops_run, resumed_matches, trained
from tests.test_diloco_w1 import FACTORY
from tests.worlds import run_in_world
from transpiler import (
    CheckpointError,
    ConfigurationError,
    Execution,
    LossScaling,
    VerificationError,
    mode_config,
    transpile,
)
from transpiler.cli import main as cli_main
from transpiler.graph.verify import check_private_state_stays


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_in_world(world, "tests.demo_worker:checks", tmp_path_factory.mktemp(f"demo{world}"))


def same(a: dict, b: dict) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: {(a[name] - b[name]).abs().max().item():.3g}"


@pytest.mark.bitwise
@pytest.mark.parametrize("case", ["reference", "reference_4bins", "reference_decay"])
def test_every_rank_follows_the_authors_step_by_step(runs, case):
    """8 steps; the momenta too, which differ between ranks (each its own data)."""
    _, ranks = runs
    for record in ranks:
        run = record[case]
        assert len(run["mine"]) == STEPS
        for mine, paper in zip(run["mine"], run["paper"]):
            same(mine, paper)
        same(run["momenta"], run["paper_momenta"])
    first = ranks[0][case]["momenta"]
    assert all(torch.equal(r[case]["mine"][-1][n], ranks[0][case]["mine"][-1][n]) for r in ranks for n in first)
    assert any(not torch.equal(first[n], r[case]["momenta"][n]) for r in ranks[1:] for n in first)


@pytest.mark.parametrize("runs", [2], indirect=True, ids=["world2"])
def test_every_coefficient_without_sign_is_sgd_on_the_mean(runs):
    """Within 1e-6: the DCT and its inverse in float32 return each momentum to within a few ulps, and what they
    leave stays in the momentum."""
    close_step_by_step(runs[1], "identity", "plain")


@pytest.mark.parametrize("runs", [2], indirect=True, ids=["world2"])
def test_sgds_weight_decay_is_the_authors_decoupled_one_within_rounding(runs):
    """SGD's ``weight_decay`` adds λθ to the sign before the step, the authors' optimizer (and the mode's
    ``weight_decay``) multiplies θ by 1 − lr·λ first: the same update, rounded differently, and the gradients move
    with the weights (measured on this machine after 8 steps at W=2: 1.04e-7 at most), so within 1e-6 but not
    bitwise."""
    close_step_by_step(runs[1], "sgd_decay", "paper")


def close_step_by_step(ranks: list[dict], case: str, other: str) -> None:
    """Every rank's weights within 1e-6 of ``other``'s after every step of ``case``."""
    for record in ranks:
        run = record[case]
        for mine, theirs in zip(run["mine"], run[other]):
            for name in mine:
                torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=0)


@pytest.mark.quick
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10, 64, 128])
def test_the_dct_bases_are_the_authors_and_within_a_ulp_of_scipys(n):
    """Bitwise the authors' FFT-built bases (written from their code in bench/authors_sparse.py); within 1e-7 of
    scipy's orthonormal DCT-II (measured: 7.4e-8 at most, for n = 3), and orthonormal within 2e-7."""
    forward, inverse = dct_bases(n)
    assert torch.equal(forward, fft_dct(torch.eye(n), False))
    assert torch.equal(inverse, fft_dct(torch.eye(n), True))
    exact = torch.from_numpy(scipy.fft.dct(np.eye(n), type=2, norm="ortho", axis=0))  # column j: unit vector j
    torch.testing.assert_close(forward.double(), exact.T, atol=1e-7, rtol=0)
    torch.testing.assert_close(inverse.double(), exact, atol=1e-7, rtol=0)
    identity = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(forward.double() @ inverse.double(), identity, atol=2e-7, rtol=0)


@pytest.mark.quick
def test_world1_message_bytes_verifier_and_dump(capsys):
    """The all-gathers carry the documented message, every bucket together; the momentum may only leave as it."""
    model = MLP()
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.01), mode_config("demo", **DEMO), LOSS)
    step(*make_batch("mlp", 8, torch.Generator().manual_seed(0)))
    program = step.programs["step"]
    gathers = [n for n in program.graph.nodes if "collective" in n.meta]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    sparsity = Sparsity(DEMO["chunk_size"], DEMO["topk"], False)
    assert sorted(n for g in gathers for n in g.meta["collective"]["grads"]) == sorted(shapes)
    for gather in gathers:
        tilings = {n: Tiling.of(shapes[n], sparsity.chunk) for n in gather.meta["collective"]["grads"]}
        sizes = {n: part_bytes(t.rows, t.width, sparsity.k(t.width), sparsity) for n, t in tilings.items()}
        rows: dict[tuple[int, int], int] = {}  # the tiles of every parameter of one width and k go as one group
        for t in tilings.values():
            rows[t.width, sparsity.k(t.width)] = rows.get((t.width, sparsity.k(t.width)), 0) + t.rows
        groups = [part_bytes(count, width, k, sparsity) for (width, k), count in rows.items()]
        assert gather.meta["collective"]["bytes"] == sum(map(sum, groups))
        # 32 × 20 in tiles of 8 × 5: 16 tiles of 40, 5 of each sent, 6-bit indices (60 bytes) and float32 values
        if "net.0.weight" in sizes:
            assert (tilings["net.0.weight"].sides, sizes["net.0.weight"]) == ((8, 5), (60, 320, 0))
    check_private_state_stays(program, True)
    message = gathers[0].args[0]
    message.meta.pop("sent")
    with pytest.raises(VerificationError, match="demo_momentum.*never leaves its rank"):
        check_private_state_stays(program, True)
    assert cli_main(["modes"]) == 0
    assert "= broadcast-params,demo-exchange,flatten-update" in capsys.readouterr().out
    plain_sgd = FACTORY.replace("tiny_factory", "plain_sgd_factory")  # DeMo steps with SGD without momentum
    assert cli_main(["dump", plain_sgd, "--mode", "demo", "-O", "topk=2"]) == 0
    out = capsys.readouterr().out
    for shown in ("x_demo_momentum_0_weight], 0.999)", "dct_", "idct_", "transpiler.sparse_select", "_foreach_sign"):
        assert shown in out
    assert "all_reduce" not in out


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, optimizer, match",
    [
        ({"quantization_bins": 1}, None, "2 to 256 bins"),
        ({"loss_scaling": LossScaling()}, None, "takes no option"),
        ({"replica_size": 2}, None, "takes no option"),
        ({}, "momentum", "SGD.*without momentum"),
        ({}, "adam", "SGD.*without momentum"),
    ],
)
def test_clear_errors(options, optimizer, match):
    model = MLP()
    make = {
        None: lambda p: torch.optim.SGD(p, lr=0.1),
        "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    }[optimizer]
    with pytest.raises(ConfigurationError, match=match):  # at transpile(), before anything is traced
        transpile(model, make(model.parameters()), mode_config("demo", **options), LOSS)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_accumulation_clipping_and_autocast_compose_as_in_fused_allreduce(autocast):
    """Every coefficient, no sign, SGD at lr 1 (which the momentum takes too) with accumulation and clipping (and
    bfloat16 autocast): ``fused_allreduce`` with the same composition, within the DCT round trip's error."""

    def sgd(params):
        return torch.optim.SGD(params, lr=1.0)

    dense = {"chunk_size": 8, "topk": 64, "compression_decay": 0.0, "sign": False}
    demo = trained("demo", {**dense, **COMPOSED}, sgd, autocast=autocast)
    fused = trained("fused_allreduce", COMPOSED, sgd, autocast=autocast)
    for a, b in zip(demo, fused):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.bitwise
def test_state_dict_carries_the_momenta_and_a_dcp_checkpoint_is_refused(tmp_path):
    """Each rank's momentum is its own, so a checkpoint read at another world size has no one answer: DCP is
    refused with what to do instead, and ``state_dict()`` (per rank) resumes bitwise."""

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01)

    assert all(same for _, same in resumed_matches("demo", DEMO, sgd, tmp_path, "state"))
    with pytest.raises(CheckpointError, match="keeps ranks apart.*Save step.state_dict"):
        resumed_matches("demo", DEMO, sgd, tmp_path, "dcp")


def test_compiled_demo_follows_the_uncompiled_step():
    """compile=True: Inductor compiles the exchange too (its top-k, packing and decoding inline: no opaque op runs;
    uncompiled, they are one op each); the message's float32 parts are read in place (4-byte aligned); within 1e-6
    of the uncompiled step after 5 steps (measured: equal)."""
    ends, ran = {}, {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = MLP()
        step = transpile(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            mode_config("demo", **DEMO),
            LOSS,
            execution=Execution(compile=flag),
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            step(*make_batch("mlp", 8, gen))
        ran[flag] = exchange_ops_run(step, make_batch("mlp", 8, gen))
        ends[flag] = [p.detach().clone() for p in model.parameters()]
    assert ran == {False: EXCHANGE_OPS, True: set()}
    for a, b in zip(ends[True], ends[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
