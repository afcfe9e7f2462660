"""The README says what is true (issues 62, 73): its table of modes is the one ``transpiler modes --markdown`` makes
from the config classes (every mode, its config, its options with their defaults, and the pipeline of each program
variant its defaults build), and it opens with the main job, then the quick tier, then the whole suite. A mode, an
option or a pass that changes without the README failing here. Static, under a second."""

from __future__ import annotations

import re

import pytest

from bench.harness.launch import ROOT
from transpiler.strategies.modes import MODES
from transpiler.strategies.modes_table import markdown_table

pytestmark = pytest.mark.quick  # static, in the quick tier
README = (ROOT / "README.md").read_text()
BEGIN, END = "<!-- transpiler modes --markdown -->\n", "<!-- end of transpiler modes --markdown -->"


def test_the_table_of_modes_is_the_one_the_configs_make():
    table = README.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table == markdown_table(), "run `transpiler modes --markdown` and paste its table into the README"
    assert [line.split(" | ")[0].strip("| `") for line in table.splitlines()[2:]] == list(MODES)


def test_the_readme_opens_with_the_main_job_then_the_quick_tier_then_the_suite():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[:3]
    assert "torchrun --nproc-per-node 2 examples/train_digits.py" in commands[0]
    assert commands[1].endswith("python -m pytest -m quick")
    assert commands[2].endswith("python -m pytest")
