"""``mode="dim_reduce"`` against DimReduce written out here from the published formulas (numpy, float64).

The reference follows MindSpore Boost's DimReduce as its docstring and code
state it: ``gk = P g``; the BFGS update of ``bk`` when a step was taken before
and ``yk·sk > 1e-20``; ``dk = -bk gk``; trials ``rho^0``, ``rho^1`` with the
Armijo test on the averaged loss, the fallback ``rho = 0`` keeping ``bk`` and
``gk_last``; ``m = gamma m + g - Pᵀ gk``; ``w -= lr (alpha m - rho Pᵀ dk)``.
It works on the global batch: with equal shards, the mean of the ranks' mean
losses (and gradients) is the global mean, so one reference serves world
sizes 1, 2 and 3. Tolerance: the transpiled step computes in float32 (as
Boost does), the reference in float64; over 6 steps the weights stay within
2e-6 of it (measured: 7.1e-7, 4.7e-7 and 4.4e-7 at world sizes 1, 2, 3). The reference also returns the
margin of every Armijo test, and the test checks none is so close to zero
that float32 rounding could flip a decision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bench.tiny_models import plain_sgd_factory
from tests import dim_reduce_problem as problem
from tests.helpers import strategy_of
from tests.worlds import run_in_world
from transpiler import ConfigurationError, DimReduce, StaticWorld, mode_config, transpile
from transpiler.build import rewrite
from transpiler.cli import main
from transpiler.graph.basis import layout
from transpiler.runtime.handshake import differences
from transpiler.runtime.process_group import Placement
from transpiler.trace.tracer import trace_step

ATOL = 2e-6
DECISION_MARGIN = 1e-4  # relative: Armijo tests closer than this to their bound would make the test fragile


def reference(batches, rows, *, rho=0.55, gamma=0.9, alpha=0.001, sigma=0.4, lr=problem.LR) -> list[dict]:
    """DimReduce on linear least squares, float64, from the formulas (see the module docstring)."""
    model = problem.model()
    w = np.concatenate([model.weight.detach().double().numpy().ravel(), model.bias.detach().double().numpy()])
    p = rows.double().numpy()
    k, n = p.shape
    bk, gk_last, sk, started, m = np.eye(k), np.zeros(k), np.zeros(k), False, np.zeros(n)

    def loss(w, x, y):
        return np.mean((x @ w[:-1] + w[-1] - y) ** 2)

    def grad(w, x, y):
        r = 2 * (x @ w[:-1] + w[-1] - y) / len(y)
        return np.concatenate([x.T @ r, [r.sum()]])

    out = []
    for x, y in batches:
        x, y = x.double().numpy(), y.double().numpy().ravel()
        g, old = grad(w, x, y), loss(w, x, y)
        gk = p @ g
        new_bk, curvature = bk, 0.0
        if started:
            yk = gk - gk_last
            curvature = yk @ sk
            if curvature > 1e-20:
                t1 = np.eye(k) - np.outer(yk, sk) / curvature
                new_bk = t1.T @ bk @ t1 + np.outer(sk, sk) / curvature
        started = True
        dk = -new_bk @ gk
        dn, proj = p.T @ dk, p.T @ gk
        chosen, margins = 0.0, []
        for r in (1.0, rho):
            bound = old + sigma * r * (gk @ dk)
            trial = loss(w + lr * r * dn, x, y)
            margins.append(abs(bound - trial) / max(abs(bound), 1e-12))
            if trial < bound:
                chosen = r
                break
        if chosen:
            sk, bk, gk_last = chosen * dk, new_bk, gk
        m = gamma * m + g - proj
        w = w - lr * (alpha * m - chosen * dn)
        out.append({"weights": w.copy(), "rho": chosen, "loss": old, "curvature": curvature, "margins": margins})
    return out


def dim_reduce(model: nn.Module, basis, **options):
    """A dim_reduce step with Boost's plain SGD, lr 1."""
    optimizer = torch.optim.SGD(model.parameters(), lr=problem.LR)
    return transpile(model, optimizer, mode_config("dim_reduce", pca_path=str(basis), **options), nn.MSELoss())


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="module")
def basis(tmp_path_factory):
    return problem.write_basis(tmp_path_factory.mktemp("dim_reduce") / "basis.pt", problem.basis_rows())


@pytest.fixture(scope="module")
def expected():
    steps = reference(problem.batches(), problem.basis_rows())
    assert all(m > DECISION_MARGIN for s in steps for m in s["margins"]), "a decision sits on its bound"
    return steps


def check_against_reference(weights, metrics, expected) -> None:
    for t, (w, seen, want) in enumerate(zip(weights, metrics, expected, strict=True)):
        assert seen["rho"] == pytest.approx(want["rho"]), f"step {t + 1}: another line-search outcome"
        assert np.abs(w.double().numpy() - want["weights"]).max() <= ATOL, f"step {t + 1}"
        assert seen["avg_loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_world_size_1_matches_the_reference_with_every_line_search_outcome(basis, expected):
    model = problem.model()
    step = dim_reduce(model, basis)
    weights, metrics = [], []
    for batch in problem.batches():
        step(*batch)
        weights.append(flat(model))
        metrics.append(dict(step.last_metrics))
    check_against_reference(weights, metrics, expected)
    # the full step, the shorter one and the fallback all happen, in the order the reference has them
    assert [m["rho"] for m in metrics] == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.55, 0.0])
    assert sorted(step.extra) == [
        "dim_reduce.bk",
        "dim_reduce.gk_last",
        "dim_reduce.sk",
        "dim_reduce.started",
        "residual_momentum.bias",
        "residual_momentum.weight",
    ]


@pytest.fixture(scope="module", params=[2, 3])
def world(request, basis, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"dim_reduce_w{request.param}")
    return run_in_world(request.param, "tests.dim_reduce_worker:checks", out, (basis,))


def test_world_sizes_2_and_3_match_the_reference_and_agree_bitwise(world, expected):
    """World size 3 holds 5 components as 2 + 2 + 1 rows: rank 2 pads one zero row, the all-gather carries 6."""
    first = world[0]["train"]
    check_against_reference(first["weights"], first["metrics"], expected)
    for rank in world[1:]:
        assert all(torch.equal(a, b) for a, b in zip(rank["train"]["weights"], first["weights"], strict=True))
        assert rank["train"]["metrics"] == first["metrics"]
    share = math.ceil(problem.COMPONENTS / len(world))
    gathers = [c for c in first["plan"] if "all_gather" in c]
    assert len(gathers) == 1 and f"'bytes': {share * 4 * len(world)}" in gathers[0]
    # the gradient bucket, the gather of gk, the back-projections, and the three losses in one all-reduce
    assert len(first["plan"]) == 4


def test_resume_from_state_dict_is_bitwise_at_every_world_size(world, basis):
    for rank in world:
        assert torch.equal(rank["resume"]["weights"], rank["train"]["weights"][-1])
        assert all(torch.equal(rank["resume"]["state"][k], v) for k, v in rank["train"]["state"].items())
    model = problem.model()  # and at world size 1, in this process
    step = dim_reduce(model, basis)
    batches = problem.batches()
    for batch in batches[:3]:
        step(*batch)
    saved = step.state_dict()
    for batch in batches[3:]:
        step(*batch)
    again = problem.model()
    resumed = dim_reduce(again, basis)
    resumed.load_state_dict(saved)
    for batch in batches[3:]:
        resumed(*batch)
    assert torch.equal(flat(again), flat(model))
    assert all(torch.equal(resumed.extra[k], v) for k, v in step.extra.items())


def test_on_a_convex_quadratic_with_a_full_basis_it_beats_gradient_descent(tmp_path):
    """P spans every weight, so the residual is zero and each step is BFGS with a line search; the curvature
    pairs of a convex quadratic are positive."""
    rows = problem.basis_rows(problem.D_IN + 1)
    path = problem.write_basis(tmp_path / "full.pt", rows)
    x, y = problem.batches(steps=1)[0]
    model, gd = problem.model(), problem.model()
    step = dim_reduce(model, path)
    gd_opt = torch.optim.SGD(gd.parameters(), lr=0.001)  # plain gradient descent with DimReduce's alpha
    ours, theirs, curvatures = [], [], []
    for _ in range(8):
        ours.append(float(step(x, y)))
        curvatures.append(step.last_metrics["curvature"])
        loss = nn.functional.mse_loss(gd(x), y)
        theirs.append(loss.item())
        gd_opt.zero_grad()
        loss.backward()
        gd_opt.step()
    assert all(a <= b for a, b in zip(ours, theirs))
    assert ours[-1] < 0.1 * ours[0]  # it actually converges, not merely beats a slow baseline
    assert all(c > 0 for c in curvatures[1:]), curvatures


@pytest.mark.quick
def test_what_dim_reduce_refuses(tmp_path, basis):
    model = problem.model()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)

    def attempt(optimizer=sgd, **options):
        return transpile(model, optimizer, mode_config("dim_reduce", **options), nn.MSELoss())

    with pytest.raises(ConfigurationError, match="needs pca_path"):
        attempt()
    with pytest.raises(ConfigurationError, match="no PCA basis at"):
        attempt(pca_path=str(tmp_path / "missing.pt"))
    with pytest.raises(ConfigurationError, match="holds 5 components"):
        attempt(pca_path=str(basis), n_components=6)
    with pytest.raises(ConfigurationError, match="SGD\\(learning_rate=1\\).*Adam"):
        attempt(torch.optim.Adam(model.parameters()), pca_path=str(basis))
    with pytest.raises(ConfigurationError, match="momentum=0.9"):
        attempt(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9), pca_path=str(basis))
    other = nn.Linear(3, 1)
    with pytest.raises(ConfigurationError, match="built for another model.*weight: basis \\[1, 8\\], model \\[1, 3\\]"):
        transpile(
            other,
            torch.optim.SGD(other.parameters(), lr=1.0),
            DimReduce(pca_path=str(basis)),
            nn.MSELoss(),
            (torch.randn(2, 3), torch.randn(2, 1)),
        )
    with pytest.raises(ConfigurationError, match="dim_reduce takes no option|works with"):
        attempt(pca_path=str(basis), accumulate_steps=2)


def test_ranks_with_different_basis_files_disagree_at_the_handshake(tmp_path):
    """Same path, other contents (another machine's file): the digest in the setup the ranks compare differs."""
    path = tmp_path / "basis.pt"
    batch = problem.shard(problem.batches()[0], 0, 2)
    setups = {}
    for rank, rows in enumerate((problem.basis_rows(4), problem.basis_rows(4) * -1)):
        problem.write_basis(path, rows)
        model = problem.model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        world = StaticWorld(size=2, rank=rank)
        step = transpile(model, optimizer, DimReduce(pca_path=str(path)), nn.MSELoss(), batch, mesh=world)
        setups[rank] = step.prepare(batch).setup
    lines = differences(setups)
    assert len(lines) == 1 and "sources" in lines[0], lines


def test_n_components_takes_the_first_rows(basis):
    model = problem.model()
    step = dim_reduce(model, basis, n_components=3)
    step(*problem.batches()[0])
    assert step.extra["dim_reduce.bk"].shape == (3, 3)


@pytest.mark.quick
def test_dump_shows_the_projection_the_gather_and_the_trial_forwards(tmp_path, capsys):
    model, *_ = plain_sgd_factory()
    names, shapes = layout(model)
    n = sum(math.prod(s) for s in shapes)
    path = tmp_path / "basis.pt"
    torch.save({"pca_mat": torch.randn(4, n), "names": names, "shapes": shapes}, path)
    factory = "bench/tiny_models.py:plain_sgd_factory"
    assert main(["dump", factory, "--mode", "dim_reduce", "-O", f"pca_path={path}", "--world-size", "3"]) == 0
    code = capsys.readouterr().out
    assert "dim_reduce_basis" in code and "aten.mm.default(dim_reduce_basis" in code  # the projection
    assert code.count("_c10d_functional.all_gather_into_tensor") == 1
    assert "trial0_" in code and "trial1_" in code  # the forwards at the trial weights
    assert code.count("_c10d_functional.all_reduce_") == 3  # gradients, back-projection, the three losses


@settings(max_examples=25, deadline=None)
@given(components=st.integers(1, 7), world=st.integers(1, 4), rank=st.integers(0, 3))
def test_every_rank_issues_the_same_collectives_and_the_pass_is_idempotent(tmp_path_factory, components, world, rank):
    """Any k and world size (padding whenever W does not divide k): every rank's program verifies, all ranks
    issue the same collectives (the static cross-rank check), and running the passes again changes nothing."""
    rank = rank % world
    path = problem.write_basis(tmp_path_factory.mktemp("basis") / "b.pt", problem.basis_rows(min(components, 9)))
    model = problem.model()
    batch = problem.batches(steps=1)[0]
    traced = trace_step(model, torch.optim.SGD(model.parameters(), lr=1.0), nn.MSELoss(), batch)[0].program
    passes = strategy_of("dim_reduce", pca_path=str(path)).variants["step"]
    program = rewrite(traced, passes, Placement(world, rank, "world", False))
    code = program.graph_module.code
    assert not any(p.run(program) for p in passes)
    program.recompile()
    assert program.graph_module.code == code
    share = math.ceil(min(components, 9) / world)
    assert program.graph_module.dim_reduce_basis.shape == (share, 9)
