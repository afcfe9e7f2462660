"""Saving a weight trajectory and building its PCA basis (the first half of DimReduce, issue 8)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.tiny_models import MLP, make_batch
from transpiler import Accumulation, ConfigurationError, Execution, mode_config, transpile
from transpiler.cli import main
from transpiler.graph.basis import flat_weights, layout, load_basis


def train(tmp_path, steps=8, every=2, **options):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = transpile(
        model,
        opt,
        mode_config("fused_allreduce", **options),
        nn.CrossEntropyLoss(),
        execution=Execution(save_trajectory=str(tmp_path), trajectory_every=every),
    )
    gen = torch.Generator().manual_seed(1)
    seen = {}
    for t in range(1, steps + 1):
        step(*make_batch("mlp", 8, gen))
        seen[t] = flat_weights(model)
    return model, seen


def test_trajectory_saves_the_documented_layout_every_m_updates(tmp_path):
    model, seen = train(tmp_path)
    files = sorted(tmp_path.glob("step_*.pt"))
    assert [f.name for f in files] == [f"step_{t:08d}.pt" for t in (2, 4, 6, 8)]
    names, shapes = layout(model)
    for f in files:
        snapshot = torch.load(f, weights_only=True)
        assert snapshot["names"] == names == [n for n, _ in model.named_parameters()]
        assert snapshot["shapes"] == shapes
        assert torch.equal(snapshot["weights"], seen[snapshot["step"]])


def test_accumulation_micro_steps_are_not_updates(tmp_path):
    train(tmp_path, steps=8, every=1, accumulation=Accumulation(steps=2))
    assert [torch.load(f, weights_only=True)["step"] for f in sorted(tmp_path.glob("*.pt"))] == [1, 2, 3, 4]


def test_pca_command_writes_the_principal_directions(tmp_path, capsys):
    train(tmp_path / "traj", steps=12, every=1)
    out = tmp_path / "pca.pt"
    assert main(["pca", str(tmp_path / "traj"), "--components", "3", "-o", str(out)]) == 0
    report = capsys.readouterr().out
    assert "12 snapshots" in report and "component   3" in report
    basis = torch.load(out, weights_only=True)
    weights = torch.stack([torch.load(f, weights_only=True)["weights"] for f in sorted((tmp_path / "traj").glob("*"))])
    centred = (weights - weights.mean(0)).double()
    p = basis["pca_mat"].double()
    assert p.shape == (3, weights.shape[1])
    torch.testing.assert_close(p @ p.T, torch.eye(3, dtype=torch.float64), atol=1e-5, rtol=0)  # orthonormal rows
    # the top direction captures the most variance: more than any other unit vector tried, e.g. the second one
    assert (centred @ p[0]).pow(2).sum() >= (centred @ p[1]).pow(2).sum()
    ratios = basis["explained_variance_ratio"]
    assert torch.all(ratios[:-1] >= ratios[1:]) and 0 < ratios.sum() <= 1 + 1e-6
    total = centred.pow(2).sum()
    torch.testing.assert_close((centred @ p.T).pow(2).sum(0) / total, ratios.double(), atol=1e-4, rtol=1e-3)


def test_pca_refuses_too_few_snapshots_and_too_many_components(tmp_path, capsys):
    assert main(["pca", str(tmp_path), "--components", "2"]) == 2
    assert "needs at least 2" in capsys.readouterr().err
    train(tmp_path, steps=4, every=1)
    assert main(["pca", str(tmp_path), "--components", "4", "-o", str(tmp_path / "p.pt")]) == 2
    assert "at most 3 principal directions" in capsys.readouterr().err


def test_trajectory_options_are_checked():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="trajectory_every"):
        transpile(
            model,
            opt,
            "fused_allreduce",
            nn.CrossEntropyLoss(),
            execution=Execution(trajectory_every=0, save_trajectory="x"),
        )
    with pytest.raises(ConfigurationError, match="only applies with save_trajectory"):
        transpile(model, opt, "fused_allreduce", nn.CrossEntropyLoss(), execution=Execution(trajectory_every=3))


def test_a_basis_is_checked_against_the_model_it_is_loaded_into(tmp_path):
    model, _ = train(tmp_path / "traj", steps=4, every=1)
    assert main(["pca", str(tmp_path / "traj"), "-k", "2", "-o", str(tmp_path / "pca.pt")]) == 0
    assert load_basis(tmp_path / "pca.pt", model)["pca_mat"].shape[0] == 2
    other = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 5))
    with pytest.raises(ConfigurationError, match="built for another model"):
        load_basis(tmp_path / "pca.pt", other)
    with pytest.raises(ConfigurationError, match="no PCA basis"):
        load_basis(tmp_path / "missing.pt", model)
