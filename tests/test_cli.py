"""The transpiler command: every format produces output; --diff shows the collectives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from transpiler.cli import main

FACTORY = "bench/tiny_models.py:tiny_factory"


@pytest.mark.quick
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


@pytest.mark.quick
def test_diff_shows_inserted_collectives(capsys):
    assert main(["dump", FACTORY, "--mode", "allreduce", "--world-size", "4", "--rank", "3", "--diff"]) == 0
    out = capsys.readouterr().out
    added = [line for line in out.splitlines() if line.startswith("+")]
    assert sum("_c10d_functional.all_reduce" in line for line in added) == 4  # one per gradient
    assert sum("_c10d_functional.wait_tensor" in line for line in added) == 4
    assert any("aten.mul.Tensor(ones_like, 0.25)" in line for line in added)


@pytest.mark.quick
def test_before_and_print_between_passes(capsys):
    assert main(["dump", FACTORY, "--before"]) == 0
    assert "all_reduce" not in capsys.readouterr().out
    assert main(["dump", FACTORY, "--before", "--format", "json"]) == 0
    assert '"role": "loss_grad"' in capsys.readouterr().out
    assert main(["dump", FACTORY, "--print-between-passes", "-O", "bucket_cap_mb=0"]) == 0
    err = capsys.readouterr().err
    for name in ("broadcast-params", "scale-loss-grad", "fuse-allreduce", "schedule-collectives"):
        assert f"after {name}" in err


@pytest.mark.quick
def test_dump_says_what_a_pass_chose(capsys):
    """zero3's default cap, ``cost``, has no all-gather to time in a dump (no processes): dump says it fell back
    to the largest module's gradients and names the cap and the module on stderr; a cap given as a number leaves
    nothing to say."""
    assert main(["dump", FACTORY, "--mode", "zero3", "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "# shard-optimizer: bucket_cap_mb=cost fell back to layer" in captured.err
    assert "bucket_cap_mb=layer:" in captured.err and "the largest module" in captured.err
    assert main(["dump", FACTORY, "--mode", "zero3", "--world-size", "2", "-O", "bucket_cap_mb=25"]) == 0
    assert "shard-optimizer" not in capsys.readouterr().err


def test_op_counts_say_what_each_pass_changed(capsys):
    """``--op-counts``: the ops each stage dispatches per step; on the narrow GPT (149 parameters) ``flatten-update``
    takes AdamW's ten ops per parameter down to ten per bucket, and ``reinplace-optimizer`` drops its copies."""
    factory = "bench/models.py:narrow_gpt_factory"
    assert main(["dump", factory, "--mode", "fused_allreduce", "--world-size", "2", "--op-counts"]) == 0
    rows = {line.split()[0]: line.split()[1:4] for line in capsys.readouterr().out.splitlines()[1:]}
    before, after = int(rows["fuse-allreduce"][0]), int(rows["flatten-update"][0])
    assert before - after >= 9 * 149 and int(rows["reinplace-optimizer"][2]) < int(rows["flatten-update"][2])


DEEP_MLP = """import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)))
    return model, torch.optim.AdamW(model.parameters()), nn.MSELoss(), (torch.randn(256, 32), torch.randn(256, 32))
"""


def test_memory_shows_the_estimate_and_a_budget_lowers_it(capsys, tmp_path):
    """``--memory``: the step's peak by kind before it runs; ``--memory-budget 0`` recomputes until the least. A
    deep MLP on 256 samples, whose activations outweigh its weights (about 6 s; the bench's narrow GPT took 50)."""
    (tmp_path / "deep_mlp.py").write_text(DEEP_MLP)
    factory = f"{tmp_path / 'deep_mlp.py'}:make"
    peaks = {}
    for budget in ([], ["--memory-budget", "0"]):
        assert main(["dump", factory, "--memory", *budget]) == 0
        out = capsys.readouterr()
        rows = {line[:40].strip(): float(line[40:].split()[0]) for line in out.out.splitlines()}
        assert "optimizer state" in rows and "at the step's peak: activations kept" in rows
        peaks[bool(budget)] = rows["peak of the step (estimated)"]
        assert ("# recompute: budget" in out.err) == bool(budget)
    assert peaks[True] < peaks[False]


def test_stages_show_one_stage_of_a_pipeline_with_its_sends_and_receives(capsys, tmp_path):
    """``--stages 2 --rank 0``: stage 0's program, its order, its balanced split and its sends and receives; and
    under interleaved 1F1B, the stage's two chunks (the deep MLP, about 6 s)."""
    (tmp_path / "deep_mlp.py").write_text(DEEP_MLP)
    factory = f"{tmp_path / 'deep_mlp.py'}:make"
    assert main(["dump", factory, "--stages", "2", "--rank", "0", "--microbatches", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.count("torch.ops.transpiler.send.default(") == 4  # each microbatch's activations
    assert out.out.count("torch.ops.transpiler.recv.default(") == 4  # and their gradients back
    assert "# split-stages: stage 0 of 2, 4 microbatches, 1f1b: F0 F1 B0 F2 B1 F3 B2 B3" in out.err
    assert "# balanced-split: split points ['2']: estimated ms per step by stage" in out.err
    interleaved = ["--pp-schedule", "interleaved_1f1b", "--virtual-stages", "2"]
    assert main(["dump", factory, "--stages", "2", "--rank", "0", "--microbatches", "4", *interleaved]) == 0
    out = capsys.readouterr()
    # chunks 0 and 2: activations to chunks 1 and 3, chunk 2's input gradients back to chunk 1; and as many received
    assert out.out.count("torch.ops.transpiler.send.default(") == 12
    assert out.out.count("torch.ops.transpiler.recv.default(") == 12
    assert "# split-stages: stage 0 of 2 (chunks 0, 2), 4 microbatches, interleaved_1f1b: F0 F1 F0.c2" in out.err


@pytest.mark.quick
def test_lists(capsys):
    assert main(["passes"]) == 0
    listed = capsys.readouterr().out
    assert all(
        name in listed
        for name in (
            "scale-loss-grad",
            "allreduce-grads",
            "fuse-allreduce",
            "broadcast-params",
            "foreach-update",
            "reinplace-optimizer",
        )
    )
    assert main(["modes"]) == 0
    modes = capsys.readouterr().out
    assert "fused_allreduce" in modes and "zero3" in modes and "flatten-update" in modes
    assert "ZeRO(stage=3): ZeRO-3" in modes and "options: bucket_cap_mb=cost, first_bucket_mb=1.0" in modes


@pytest.mark.quick
def test_a_config_file_a_pipeline_and_dotted_options_build_what_the_mode_builds(tmp_path, capsys):
    """``--config FILE`` (as ``config.to_json()`` writes it, ``-O`` on top), ``--mode`` with a feature's field
    dotted, and ``--pipeline``: the same program for the same config; an option's old name still works, and says
    its new one on stderr."""
    from transpiler import Accumulation, Clipping, ZeRO

    config = tmp_path / "zero2.json"
    config.write_text(ZeRO(stage=2, accumulation=Accumulation(steps=2)).to_json())
    assert main(["dump", FACTORY, "--config", str(config), "-O", "clipping.max_norm=0.5"]) == 0
    from_file = capsys.readouterr().out
    dotted = ["-O", "accumulation.steps=2", "-O", "clipping.max_norm=0.5"]
    assert main(["dump", FACTORY, "--mode", "zero2", *dotted]) == 0
    assert capsys.readouterr().out == from_file and "linalg_vector_norm" in from_file  # the clipping
    assert main(["dump", FACTORY, "--mode", "zero2", "-O", "accumulate_steps=2", "-O", "max_grad_norm=0.5"]) == 0
    old = capsys.readouterr()
    assert old.out == from_file and "'accumulate_steps' is now accumulation.steps" in old.err
    assert ZeRO(stage=2, accumulation=Accumulation(steps=2), clipping=Clipping(max_norm=0.5)).mode == "zero2"
    spec = "broadcast-params,scale-loss-grad,allreduce-grads,reinplace-optimizer"
    assert main(["dump", FACTORY, "--pipeline", spec]) == 0
    assert "all_reduce" in capsys.readouterr().out
    assert main(["dump", FACTORY, "--mode", "zero2", "--pipeline", spec]) == 2
    assert "give one of --mode, --config and --pipeline" in capsys.readouterr().err


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


@pytest.mark.quick
def test_local_sgd_variants(capsys):
    assert main(["dump", FACTORY, "--mode", "local_sgd", "--variant", "local"]) == 0
    assert "all_reduce" not in capsys.readouterr().out
    assert main(["dump", FACTORY, "--mode", "local_sgd", "--variant", "sync", "-O", "k_steps=4"]) == 0
    assert "x_snapshot_" in capsys.readouterr().out
    assert main(["dump", FACTORY, "--mode", "local_sgd", "--variant", "nope"]) == 2


@pytest.mark.quick
def test_help_is_plain_and_shows_defaults(capsys):
    for argv in (["--help"], ["dump", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "``" not in text
    assert "(default: 2)" in text and "(default: fused_allreduce)" in text and "Graphviz" in text


@pytest.mark.quick
def test_dump_details_a_new_user_sees(tmp_path, capsys):
    assert main(["dump", FACTORY, "--diff", "--format", "svg", "-o", str(tmp_path / "x.svg")]) == 2
    assert "--diff" in capsys.readouterr().err and not (tmp_path / "x.svg").exists()
    assert main(["dump", FACTORY]) == 0
    assert not capsys.readouterr().out.startswith("\n")
    target = tmp_path / "new" / "folder" / "step.py"
    assert main(["dump", FACTORY, "-o", str(target)]) == 0 and target.read_text().startswith("def forward")
    assert main(["modes"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    columns = {len(line) - len(line[len(line.split()[0]) :].lstrip()) for line in rows}
    assert len(columns) == 1  # every summary starts in one column


@pytest.mark.quick
def test_factory_files_that_used_to_end_in_a_traceback_or_silence(tmp_path, capsys):
    txt = tmp_path / "factory.txt"
    txt.write_text("def make(): pass\n")
    assert main(["dump", f"{txt}:make"]) == 2
    assert ".py" in capsys.readouterr().err
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\ndef make():\n    sys.exit(3)\n")
    assert main(["dump", f"{exits}:make"]) == 2
    assert "sys.exit(3)" in capsys.readouterr().err
    dc = tmp_path / "with_dataclass.py"
    dc.write_text(
        "from __future__ import annotations\nimport dataclasses\nimport sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from bench.tiny_models import tiny_factory\n\n@dataclasses.dataclass\nclass Config:\n    width: int = 8\n\n"
        "def make():\n    Config()\n    return tiny_factory()\n"
    )
    assert main(["dump", f"{dc}:make"]) == 0


def test_the_installed_command_runs_from_a_shell(tmp_path):
    """The console script pip installed (``transpiler``, next to this interpreter), as a user types it, in a
    fresh process from another directory: a diff and a DOT drawing, each exiting 0 (what ``modes`` and ``passes``
    print is test_lists', in this process: each fresh process costs an import of torch)."""
    import subprocess
    import sys

    command = Path(sys.executable).parent / "transpiler"
    assert command.exists(), f"no console script at {command}: pip install -e . installs it"
    factory = str(Path(__file__).parents[1] / "bench" / "tiny_models.py") + ":tiny_factory"
    dot = tmp_path / "graph.dot"
    script = "; ".join(
        f"{command} {args} || exit $?; echo '<<end>>'"
        for args in (
            f"dump {factory} --mode fused_allreduce --world-size 2 --diff",
            f"dump {factory} --mode zero2 --world-size 2 --format dot -o {dot}",
        )
    )
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    diff, wrote, _ = done.stdout.split("<<end>>")
    assert diff.lstrip().startswith("--- traced") and "+    all_reduce" in diff
    drawn = dot.read_text()  # zero2 over gloo: the reduce-scatter is an all_to_all (gloo has no reduce_scatter)
    assert drawn.lstrip().startswith("digraph") and "all_to_all_single" in drawn and "all_gather_into_tensor" in drawn


@pytest.mark.quick
def test_schedule_of_a_mode_that_follows_its_loss_is_refused_in_words(capsys):
    """adaptive_local_sgd picks k from the loss it measures: no table of calls exists before the run."""
    assert main(["dump", FACTORY, "--mode", "adaptive_local_sgd", "--schedule", "3"]) == 2
    assert "follows a metric measured while training ('avg_loss')" in capsys.readouterr().err
    assert main(["dump", FACTORY, "--mode", "local_sgd", "-O", "k_steps=2", "--schedule", "3"]) == 0
    rows = [line.split(" | ")[1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["sync", "local", "sync"]  # begin_step=1 syncs the first step, then every k=2
