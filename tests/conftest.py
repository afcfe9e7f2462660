import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import Phase, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Hypothesis profiles. `ci` (the default) is derandomised: every run draws the same examples, so a red CI is
# reproducible and a green one does not change by chance. `dev` draws new examples each run and keeps failures in
# .hypothesis/ (HYPOTHESIS_PROFILE=dev python -m pytest): use it to search while changing a pass.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
# `quick`: `ci` without shrinking, for the quick tier (-m quick): a property a broken pass fails is reported with the
# first example that fails it, at once; shrinking hundreds of builds took that tier from 1 to 11 minutes. Run the
# file without -m quick to shrink the example.
settings.register_profile("quick", parent=settings.get_profile("ci"), phases=[p for p in Phase if p != Phase.shrink])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Inductor compiles a program's kernels in a pool of worker processes, one per core, each importing torch first.
# The suite's two workers keep both cores busy, so the pool adds only its start (in every rank that compiles):
# compile in the process that asks, here and in the ranks this session starts (they inherit the environment).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_configure(config):
    """The quick tier (``-m quick``) takes hypothesis's ``quick`` profile unless one is named."""
    if "quick" in (config.option.markexpr or "") and "HYPOTHESIS_PROFILE" not in os.environ:
        settings.load_profile("quick")


# Worker-seconds of the heaviest files in the suite on the slowest CI machine (a 2-core AMD EPYC, two workers; the
# summary at the end of a run prints them: refresh this from it). `--dist loadfile` gives each worker whole files,
# handed out in collection order (`--no-loadscope-reorder`): the heaviest first, then the others in the shuffled
# order, so the last file a worker takes is a light one and the two end together (xdist's own order, by number
# of tests, can leave files of few but long tests, such as a world of 8, for the end).
FILE_SECONDS = {  # commit 174c1d5 on the AMD EPYC, 2026-12-01
    "test_quorum.py": 292,
    "test_tensor_parallel.py": 254,
    "test_zero.py": 243,
    "test_diloco_w1.py": 213,
    "test_recompute.py": 187,
    "test_mode_ops_gate.py": 162,
    "test_demo.py": 120,
    "test_pipeline.py": 115,
    "test_zero_static.py": 100,
    "test_pipeline_features.py": 100,
    "test_quorum_example.py": 79,
    "test_restarts.py": 68,
    "test_multihost.py": 67,
    "test_pipeline_3d.py": 61,
    "test_elastic.py": 58,
}


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(config, items):
    """The heaviest files first (``FILE_SECONDS``; a stable sort keeps the shuffled order among the others and
    within each file). ``quick_subset`` tests repeat, on less, a claim a full test checks: they run only when ``-m``
    names the quick tier (``-m quick``), never beside the full tests they shorten (the README's full run, CI)."""
    items.sort(key=lambda item: -FILE_SECONDS.get(Path(str(item.fspath)).name, 0))
    if "quick" in (config.option.markexpr or ""):
        return
    subset = [item for item in items if item.get_closest_marker("quick_subset")]
    if subset:
        config.hook.pytest_deselected(items=subset)
        items[:] = [item for item in items if not item.get_closest_marker("quick_subset")]


_busy: dict[str, float] = defaultdict(float)  # worker-seconds per file, and per worker (on the controller)


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # the xdist worker that ran it (absent without xdist)
    worker = node.gateway.id if node is not None else "main"
    _busy[Path(report.fspath).name] += report.duration
    _busy[f"worker {worker}"] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Each worker's busy seconds (how evenly the files fell), and the heaviest files (for ``FILE_SECONDS``)."""
    workers = {k: v for k, v in _busy.items() if k.startswith("worker ")}
    files = sorted(((v, k) for k, v in _busy.items() if k not in workers), reverse=True)[:15]
    terminalreporter.write_line(
        "busy seconds per worker: " + ", ".join(f"{k[7:]} {v:.0f}" for k, v in sorted(workers.items()))
    )
    terminalreporter.write_line("heaviest files (seconds): " + ", ".join(f"{k} {v:.0f}" for v, k in files))


def pytest_sessionfinish(session, exitstatus):
    """End the worlds of ranks the session kept (tests/worlds.py)."""
    from tests.worlds import close_all

    close_all()
