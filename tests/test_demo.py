"""DeMo: on real processes (gloo over loopback, the worlds of 2 and 4 ranks test_diloco.py also uses, each rank on
its own data) against the paper's loop run eagerly for every rank (tests/demo_worker.py); in one process, the DCT
against scipy's, the wire format, the verifier, the dump and the errors.

Bitwise at W=2 and W=4: every rank adds the decoded coefficients in rank order, as the reference does, and each
DCT is the same matrix product on one CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from passes.demo_exchange import dct_matrix
from passes.sparse_pseudo_exchange import message_bytes
from tests.demo_worker import DEMO, STEPS, dct
from tests.diloco_worker import LOSS
from tests.helpers import COMPOSED, resumed_matches, trained
from tests.models import MLP, make_batch
from tests.test_diloco_w1 import FACTORY
from tests.worlds import run_in_world
from transpiler import CheckpointError, ConfigurationError, VerificationError, transpile
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
@pytest.mark.parametrize("case", ["reference", "reference_4bit"])
def test_every_rank_follows_the_paper_step_by_step(runs, case):
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
def test_every_coefficient_without_sign_is_sgd_with_momentum_on_the_mean_gradient(runs):
    """Within 1e-6: the DCT and its inverse in float32 return each momentum to within a few ulps (measured: the
    weights differ by about 1e-8 after 8 steps), and what they leave stays in the momentum."""
    _, ranks = runs
    for record in ranks:
        run = record["identity"]
        for mine, plain in zip(run["mine"], run["plain"]):
            for name in mine:
                torch.testing.assert_close(mine[name], plain[name], atol=1e-6, rtol=0)


@pytest.mark.quick
@pytest.mark.parametrize("n", [2, 3, 16, 64, 100, 128])
def test_the_dct_is_scipys_orthonormal_dct_ii(n):
    """Bitwise scipy's for powers of two (the chunk sizes the docs suggest); otherwise within 1e-7 (the formula's
    cos(π/2) is 6e-17, scipy's FFT gives 0)."""
    matrix, theirs = dct_matrix(n), dct(n)
    if n & (n - 1) == 0:
        assert torch.equal(matrix, theirs)
    torch.testing.assert_close(matrix, theirs, atol=1e-7, rtol=0)
    identity = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(matrix.double() @ matrix.double().T, identity, atol=1e-6, rtol=0)


@pytest.mark.quick
def test_world1_message_bytes_verifier_and_dump(capsys):
    """The all-gathers carry the documented message, every bucket together; the momentum may only leave as it."""
    model = MLP()
    step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.01), "demo", LOSS, **DEMO)
    step(*make_batch("mlp", 8, torch.Generator().manual_seed(0)))
    program = step.programs["step"]
    gathers = [n for n in program.graph.nodes if "collective" in n.meta]
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    k, chunk = DEMO["compression_topk"], DEMO["compression_chunk"]
    assert sorted(n for g in gathers for n in g.meta["collective"]["grads"]) == sorted(sizes)
    for gather in gathers:
        rows = sum(math.ceil(sizes[n] / chunk) for n in gather.meta["collective"]["grads"])
        assert gather.meta["collective"]["bytes"] == sum(message_bytes(rows, k, chunk, 32))
    check_private_state_stays(program, True)
    message = gathers[0].args[0]
    message.meta.pop("sent")
    with pytest.raises(VerificationError, match="demo_momentum.*never leaves its rank"):
        check_private_state_stays(program, True)
    assert cli_main(["modes"]) == 0
    assert "= broadcast-params,demo-exchange,flatten-update" in capsys.readouterr().out
    assert cli_main(["dump", FACTORY, "--mode", "demo", "-O", "compression_topk=2"]) == 0
    out = capsys.readouterr().out
    for shown in ("x_demo_momentum_0_weight, 0.999", "dct_64", "sparse_pseudo_exchange_select", "sign.default"):
        assert shown in out
    assert "all_reduce" not in out


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, match",
    [
        ({"value_bits": 16}, "2, 4, 8 or 32 bits"),
        ({"compression_topk": 65}, "topk <= chunk"),
        ({"loss_scale": "dynamic"}, "takes no option"),
        ({"replica_size": 2}, "takes no option"),
    ],
)
def test_clear_errors(options, match):
    model = MLP()
    with pytest.raises(ConfigurationError, match=match):
        transpile(model, torch.optim.SGD(model.parameters(), lr=0.1), "demo", LOSS, **options)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_accumulation_clipping_and_autocast_compose_as_in_fused_allreduce(autocast):
    """Every coefficient, no sign, with accumulation and clipping (and bfloat16 autocast): ``fused_allreduce`` with
    the same composition, within the DCT round trip's error (measured: 1.5e-8 after 12 calls)."""

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    dense = {"compression_chunk": 16, "compression_topk": 16, "sign": False}
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
    """compile=True: the message's float32 parts are read in place (4-byte aligned), which Inductor keeps; within
    1e-6 of the uncompiled step after 4 steps (measured: equal)."""
    ends = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = MLP()
        step = transpile(model, torch.optim.SGD(model.parameters(), lr=0.01), "demo", LOSS, compile=flag, **DEMO)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            step(*make_batch("mlp", 8, gen))
        ends[flag] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(ends[True], ends[False]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
