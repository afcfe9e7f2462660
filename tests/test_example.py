"""The README's main job, ``examples/train_digits.py``, in a real world of 2 under ``zero3``: the mode whose model
holds slices between steps, so the script's evaluation and ``--save-model`` must run inside ``step.gathered()``."""

from __future__ import annotations

import torch

from tests.distributed import ROOT, launch


def test_digits_example_trains_evaluates_and_saves_under_zero3(tmp_path):
    saved = tmp_path / "model.pt"
    script = ROOT / "examples" / "train_digits.py"
    ranks = launch(script, 2, ["--mode", "zero3", "--epochs", "2", "--save-model", str(saved)], timeout=120)
    accuracy = float(ranks[0].stdout.split("test accuracy")[1].split()[0])
    assert accuracy > 0.5, ranks[0].stdout[-2000:]
    plain = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    plain.load_state_dict(torch.load(saved, weights_only=True))  # whole tensors, not this rank's slices
