"""The transpiler command: every format produces output; --diff shows the collectives."""

from __future__ import annotations

import json
import shutil

import pytest

from transpiler.cli import main

FACTORY = "tests/models.py:tiny_factory"


@pytest.mark.parametrize("fmt", ["code", "dot", "svg", "json"])
def test_every_format(fmt, tmp_path, capsys):
    if fmt == "svg" and shutil.which("dot") is None:
        pytest.skip("Graphviz 'dot' is not installed (.ci/run installs it)")
    out = tmp_path / f"graph.{fmt}"
    assert (
        main(["dump", FACTORY, "--mode", "fused_allreduce", "--world-size", "2", "--format", fmt, "-o", str(out)]) == 0
    )
    text = out.read_text()
    assert "all_reduce" in text
    if fmt == "json":
        doc = json.loads(text)
        assert doc["world_size"] == 2 and any("collective" in n for n in doc["nodes"])
    if fmt == "svg":
        assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_diff_shows_inserted_collectives(capsys):
    assert main(["dump", FACTORY, "--mode", "allreduce", "--world-size", "4", "--rank", "3", "--diff"]) == 0
    out = capsys.readouterr().out
    added = [line for line in out.splitlines() if line.startswith("+")]
    assert sum("_c10d_functional.all_reduce" in line for line in added) == 4  # one per gradient
    assert sum("_c10d_functional.wait_tensor" in line for line in added) == 4
    assert any("aten.mul.Tensor(ones_like, 0.25)" in line for line in added)


def test_before_and_print_between_passes(capsys):
    assert main(["dump", FACTORY, "--before"]) == 0
    assert "all_reduce" not in capsys.readouterr().out
    assert main(["dump", FACTORY, "--before", "--format", "json"]) == 0
    assert '"role": "loss_grad"' in capsys.readouterr().out
    assert main(["dump", FACTORY, "--print-between-passes", "-O", "bucket_cap_mb=0"]) == 0
    err = capsys.readouterr().err
    for name in ("broadcast-params", "scale-loss-grad", "fuse-allreduce", "schedule-collectives"):
        assert f"after {name}" in err


def test_lists(capsys):
    assert main(["passes"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("scale-loss-grad", "allreduce-grads", "fuse-allreduce", "broadcast-params"))
    assert main(["modes"]) == 0
    assert "fused_allreduce" in capsys.readouterr().out


def test_adasum_dump_shows_exchanges_with_their_partners(capsys):
    assert main(["dump", FACTORY, "--mode", "adasum", "--world-size", "8", "--rank", "5", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    exchanges = [(n["p2p"]["peer"], n["p2p"]["level"], n["p2p"]["phase"]) for n in doc["nodes"] if "p2p" in n]
    assert exchanges == [
        (4, 1, "reduce"),
        (7, 2, "reduce"),
        (1, 4, "reduce"),
        (1, 4, "rollback"),
        (7, 2, "rollback"),
        (4, 1, "rollback"),
    ]
    assert main(["dump", FACTORY, "--mode", "adasum", "--world-size", "8", "--rank", "5"]) == 0
    assert "transpiler.exchange.default(" in capsys.readouterr().out


def test_local_sgd_variants(capsys):
    assert main(["dump", FACTORY, "--mode", "local_sgd", "--variant", "local"]) == 0
    assert "all_reduce" not in capsys.readouterr().out
    assert main(["dump", FACTORY, "--mode", "local_sgd", "--variant", "sync", "-O", "k_steps=4"]) == 0
    assert "x_snapshot_" in capsys.readouterr().out
    assert main(["dump", FACTORY, "--mode", "local_sgd", "--variant", "nope"]) == 2
