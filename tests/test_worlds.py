"""The session's worlds (tests/worlds.py) retry a job once after a rank's native crash, and nothing else."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.worlds import RankCrashed, RetriedAfterCrash, run_in_world


def crash(rank: int, world: int, folder: str, crashes: str) -> int:
    """Die of SIGSEGV the first ``crashes`` times this job runs in ``folder``, then return how often it ran."""
    runs = len(list(Path(folder).glob("ran-*"))) + 1
    Path(folder, f"ran-{runs}").touch()
    if runs <= int(crashes):
        os.kill(os.getpid(), signal.SIGSEGV)
    return runs


def fail(rank: int, world: int, folder: str) -> None:
    """Raise a Python error, counting the runs in ``folder``."""
    Path(folder, f"ran-{len(list(Path(folder).glob('ran-*'))) + 1}").touch()
    raise ValueError("a wrong result")


def test_a_job_whose_rank_crashed_runs_again_in_a_new_world_with_a_warning(tmp_path):
    with pytest.warns(RetriedAfterCrash, match=r"died of SIGSEGV[\s\S]*Fatal Python error: Segmentation fault"):
        assert run_in_world(1, "tests.test_worlds:crash", tmp_path, (tmp_path, 1)) == [2]


def test_a_second_crash_fails(tmp_path):
    with pytest.warns(RetriedAfterCrash), pytest.raises(RankCrashed, match="died of SIGSEGV"):
        run_in_world(1, "tests.test_worlds:crash", tmp_path, (tmp_path, 2))
    assert len(list(tmp_path.glob("ran-*"))) == 2


def test_a_python_error_is_not_retried(tmp_path):
    with pytest.raises(AssertionError, match=r"\(exit 1\)[\s\S]*ValueError: a wrong result") as error:
        run_in_world(1, "tests.test_worlds:fail", tmp_path, (tmp_path,))
    assert not isinstance(error.value, RankCrashed)
    assert len(list(tmp_path.glob("ran-*"))) == 1
