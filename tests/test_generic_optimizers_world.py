"""Generic-path optimizers at world size 2 in one spawned world (tests/optimizer_worker.py), per mode.

* ``fused_allreduce`` against DDP with the same optimizer: bitwise, as for the twins (the averaged gradient
  is the same bits, and the traced step runs the optimizer's own arithmetic), except RAdam and ASGD (their
  tensor forms: ``TENSOR_PATH_TOL``).
* ``local_sgd`` (k_steps=2) against eager local steps averaged after each sync: tolerance, because the
  average is taken as ``snapshot - sum(deltas)/W``, which rounds differently from ``sum(p)/W``.
* ``adasum`` against the eager optimizer fed the two-rank AdaSum of the gradients written out in the worker:
  tolerance (float64 dot products reduced in another order).
"""

from __future__ import annotations

import pytest
import torch

from tests.optimizer_worker import OPTIMIZERS
from tests.worlds import run_in_world

TENSOR_PATH_TOL = 1e-6
AVERAGING_TOL = dict(atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_in_world(2, "tests.optimizer_worker:checks", tmp_path_factory.mktemp("optimizers2"))


def _close(ours: dict, ref: dict, what: str, bitwise: bool, **tol) -> None:
    for name, value in ours.items():
        if bitwise:
            assert torch.equal(value, ref[name]), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(value, ref[name], msg=f"{what}: {name}", **tol)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_allreduce_matches_ddp(ranks, name):
    record = ranks[0][name]
    for t, (ours, ddp) in enumerate(zip(record["fused_allreduce"]["ours"], record["ddp"])):
        exact = name not in ("RAdam", "ASGD")
        _close(ours, ddp, f"{name} step {t}", exact, atol=TENSOR_PATH_TOL, rtol=0)
        _close(ranks[1][name]["fused_allreduce"]["ours"][t], ours, f"{name} step {t} across ranks", True)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_local_sgd_matches_averaged_local_steps(ranks, name):
    record = ranks[0][name]
    assert "local" in record["local_sgd"]["variants"] and "sync" in record["local_sgd"]["variants"]
    for t, (ours, ref) in enumerate(zip(record["local_sgd"]["ours"], record["local_ref"])):
        _close(ours, ref, f"{name} local_sgd step {t}", False, **AVERAGING_TOL)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_adasum_matches_the_published_combination(ranks, name):
    record = ranks[0][name]
    for t, (ours, ref) in enumerate(zip(record["adasum"]["ours"], record["adasum_ref"])):
        _close(ours, ref, f"{name} adasum step {t}", False, **AVERAGING_TOL)
        _close(ranks[1][name]["adasum"]["ours"][t], ours, f"{name} adasum step {t} across ranks", True)
