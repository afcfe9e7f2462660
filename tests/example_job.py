"""The digits example (``examples/train_digits.py``) as a job of a session's world (tests/worlds.py): its
``main`` with a command line, in the world's process group, what rank 0 printed returned as the result."""

from __future__ import annotations

import contextlib
import importlib.util
import io

from bench.harness.launch import ROOT


def train(rank: int, world: int, *argv: str) -> dict:
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples" / "train_digits.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.main(list(argv))
    return {"stdout": printed.getvalue()}
