"""The README says what is true (issue 62): its table of modes lists every mode, and each pipeline it writes out is
one the mode builds with its defaults; it opens with the main job, then the quick tier, then the whole suite. A
pipeline a pass or a mode changes without the README failing here. Static, under a second."""

from __future__ import annotations

import re

import pytest

from tests.distributed import ROOT
from transpiler.strategies.modes import modes

pytestmark = pytest.mark.quick  # static, in the quick tier
README = (ROOT / "README.md").read_text()


def _mode_rows() -> dict[str, str]:
    """The rows of the README's table of modes, by mode."""
    table = README.split("### Modes and pipelines", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = line.split(" | ")
        rows[cells[0].strip("| `")] = line
    return rows


def test_the_table_of_modes_lists_every_mode_and_no_other():
    assert set(_mode_rows()) == set(modes())


@pytest.mark.parametrize("mode", sorted(modes()))
def test_each_pipeline_the_table_writes_out_is_one_the_mode_builds(mode):
    """A spec in the row (`broadcast-params,...`) with its placeholders (`{index=i}`, `{pca-path=...}`) taken as
    any value. Rows that describe a mode by another's ("as `zero1` with ...") write none out."""
    built = set(modes()[mode].strategy(**({"pca_path": "basis.pt"} if mode == "dim_reduce" else {})).specs().values())
    written = [s for s in re.findall(r"`([^`]+)`", _mode_rows()[mode]) if s.startswith("broadcast-params,")]
    for spec in written:
        pattern = re.escape(spec).replace(r"=i", r"=\d+").replace(r"=\.\.\.", r"=[^,}]+")
        # an option the default leaves out of the spec (index=0) may be written as a placeholder too
        loose = pattern.replace(r"\{index=\d+\}", r"(\{index=\d+\})?")
        assert any(re.fullmatch(loose, b) for b in built), f"{mode}: README has {spec}; it builds {sorted(built)}"


def test_the_readme_opens_with_the_main_job_then_the_quick_tier_then_the_suite():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[:3]
    assert "torchrun --nproc-per-node 2 examples/train_digits.py" in commands[0]
    assert commands[1].endswith("python -m pytest -m quick")
    assert commands[2].endswith("python -m pytest")
