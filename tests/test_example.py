"""The README's runs, ``examples/train_digits.py`` in real worlds: the main job (2 processes, ``fused_allreduce``)
and each 4-process mode the README lists, each to the accuracy the README states; and ``zero3``, the mode whose
model holds slices between steps, so the script's evaluation and ``--save-model`` must run inside
``step.gathered()``."""

from __future__ import annotations

import pytest
import torch

from bench.harness.launch import ROOT, launch
from tests.worlds import run_in_world
from transpiler import ZeRO

SCRIPT = ROOT / "examples" / "train_digits.py"
README = (ROOT / "README.md").read_text()
# what the README promises: "about 0.97" for the main job, ">= 0.96" for every 4-process mode
MAIN_JOB = "torchrun --nproc-per-node 2 examples/train_digits.py --mode fused_allreduce"
FOUR = {
    "local_sgd": "--mode local_sgd -O k_steps=4",
    "adaptive_local_sgd": "--mode adaptive_local_sgd",
    "adasum": "--mode adasum",
    "adasum_delta": "--mode adasum_delta",
    "adasum_local_size_2": "--mode adasum -O local_size=2",
}


def accuracy_of(ranks) -> float:
    """What rank 0 printed last, from a launched world (processes) or the session's (``stdout`` results)."""
    printed = ranks[0].stdout if hasattr(ranks[0], "stdout") else ranks[0]["stdout"]
    return float(printed.split("test accuracy")[1].split()[0])


def test_the_readme_main_job_reaches_its_accuracy():
    assert MAIN_JOB in README  # the command the README opens with
    ranks = launch(SCRIPT, 2, MAIN_JOB.split(" ", 4)[-1].split(), timeout=120)
    assert accuracy_of(ranks) >= 0.96, ranks[0].stdout[-2000:]


@pytest.mark.parametrize("name", list(FOUR))
def test_each_four_process_mode_of_the_readme_reaches_its_accuracy(name, tmp_path):
    """The script's main, in the session's world of four (the main job above runs it as a script)."""
    assert f"`{FOUR[name]}`" in README or f"examples/train_digits.py {FOUR[name]}`" in README, FOUR[name]
    ranks = run_in_world(4, "tests.example_job:train", tmp_path, FOUR[name].split(), timeout=200)
    assert accuracy_of(ranks) >= 0.96, ranks[0]["stdout"][-2000:]


def test_digits_example_trains_evaluates_and_saves_under_zero3(tmp_path):
    """Two epochs: this checks the script's zero3 path, not the README's accuracy (the tests above do); the mode
    comes as a ``--config`` file, as a user saves it with ``config.to_json()``."""
    saved, config = tmp_path / "model.pt", tmp_path / "zero3.json"
    config.write_text(ZeRO(stage=3).to_json())
    argv = ["--config", config, "--epochs", "2", "--save-model", saved]
    ranks = run_in_world(2, "tests.example_job:train", tmp_path, argv, timeout=120)
    assert accuracy_of(ranks) > 0.5, ranks[0]["stdout"][-2000:]
    plain = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    plain.load_state_dict(torch.load(saved, weights_only=True))  # whole tensors, not this rank's slices
