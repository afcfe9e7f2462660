import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Hypothesis profiles. `ci` (the default) is derandomised: every run draws the same examples, so a red CI is
# reproducible and a green one does not change by chance. `dev` draws new examples each run and keeps failures in
# .hypothesis/ (HYPOTHESIS_PROFILE=dev python -m pytest): use it to search while changing a pass.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Inductor compiles a program's kernels in a pool of worker processes, one per core, each importing torch first.
# The suite's two workers keep both cores busy, so the pool adds only its start (in every rank that compiles):
# compile in the process that asks, here and in the ranks this session starts (they inherit the environment).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_sessionfinish(session, exitstatus):
    """End the worlds of ranks the session kept (tests/worlds.py)."""
    from tests.worlds import close_all

    close_all()
