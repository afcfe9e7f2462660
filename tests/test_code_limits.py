"""What issue 73 holds the code to, statically (under a second): small modules and functions in the two packages,
and the benches and the example as modules of the installed project, standing on their own."""

from __future__ import annotations

import ast
import re

import pytest

from bench.harness.launch import ROOT

pytestmark = pytest.mark.quick
MODULE_LINES, FUNCTION_LINES = 400, 80


def _sources(*folders: str):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_module_of_the_packages_is_over_400_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for path in _sources("transpiler", "passes"):
        text = path.read_text()
        if text.count("\n") > MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules and not long_functions, long_modules + long_functions


def test_the_benches_and_the_example_import_no_test_and_patch_no_import_path():
    """They run as modules from the repository's root (``python -m bench.wan``) beside the installed package; what
    they share with the tests is in ``bench/harness`` and ``bench/tiny_models.py``, which the tests import, never
    the other way."""
    found = []
    for path in _sources("bench", "examples"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if "sys.path" in line or re.search(r"\bfrom tests\b|\bimport tests\b", line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, found
