"""Golden graphs: the code of a tiny model's step before and after each pass.

Regenerate after an intended change with ``UPDATE_GOLDEN=1 pytest tests/test_golden.py``
and read the diff before committing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.tiny_models import tiny_factory
from transpiler import StaticWorld, mode_config, transpile

pytestmark = pytest.mark.quick  # the quick tier: static, a second in all

GOLDEN = Path(__file__).parent / "golden"
CASES = {"allreduce": {}, "fused_allreduce": {"bucket_cap_mb": 0.0002, "first_bucket_mb": 0.0001}}
GOLDEN_TORCH = "2.13"  # the torch whose traces the files hold: another version names and orders ops differently


@pytest.fixture(autouse=True)
def _golden_torch():
    if not torch.__version__.startswith(GOLDEN_TORCH) and not os.environ.get("UPDATE_GOLDEN"):
        pytest.skip(f"the golden graphs are torch {GOLDEN_TORCH}'s trace text; this is torch {torch.__version__}")


def _stages(mode: str) -> list[tuple[str, str]]:
    """(label, code) after tracing and after each pass, then the startup program."""
    model, optimizer, loss_fn, batch = tiny_factory()
    step = transpile(
        model,
        optimizer,
        mode_config(mode, **CASES[mode]),
        loss_fn=loss_fn,
        example_inputs=batch,
        mesh=StaticWorld(size=2, rank=0),
    )
    return [*step.program.history, ("startup", step.program.startup.code)]


@pytest.mark.parametrize("mode", CASES)
def test_graph_after_each_pass_matches_golden(mode):
    for index, (label, code) in enumerate(_stages(mode)):
        path = GOLDEN / mode / f"{index}_{label.split('{')[0]}.py.txt"
        if os.environ.get("UPDATE_GOLDEN"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
        assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
        assert code == path.read_text(), f"graph after '{label}' changed; see {path}"
