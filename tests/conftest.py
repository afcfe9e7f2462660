import os
import sys

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


def pytest_collection_modifyitems(config, items):
    """``quick_subset`` tests repeat, on less, a claim a full test checks: they run only when ``-m`` names the
    quick tier (``-m quick``), never beside the full tests they shorten (the README's full run, CI)."""
    if "quick" in (config.option.markexpr or ""):
        return
    subset = [item for item in items if item.get_closest_marker("quick_subset")]
    if subset:
        config.hook.pytest_deselected(items=subset)
        items[:] = [item for item in items if not item.get_closest_marker("quick_subset")]


def pytest_sessionfinish(session, exitstatus):
    """End the worlds of ranks the session kept (tests/worlds.py)."""
    from tests.worlds import close_all

    close_all()
