"""The quick tier's worlds (issue 62): one world of 2 real ranks per family of modes whose full world is too long
for it, each a few scenarios of that family's full job, held to the same checks (the full tests' own functions).
They run only under ``-m quick`` (marker ``quick_subset``): the full suite checks every scenario of these jobs in
their own files. Local SGD's world of 2 is cheap and in the quick tier as it is (tests/test_local_sgd.py), and
fault tolerance is there statically (tests/test_quorum.py). About 25 s on 2 cores."""

from __future__ import annotations

import pytest

from tests import test_diloco, test_parity, test_zero
from tests.worlds import run_in_world

pytestmark = [pytest.mark.quick, pytest.mark.quick_subset]
PARITY = ("mlp,adam,fused_allreduce", "tied,sgd,allreduce", "cnn,sgd,fused_allreduce")
ZERO = ("tied,sgd,zero1,1", "tied,adamw,zero2,1", "tied,adamw,zero3,1")


def test_data_parallel_is_ddp_bitwise_at_two_ranks(tmp_path):
    """``allreduce`` and ``fused_allreduce`` against DDP (bitwise) and one process (tests/test_parity.py)."""
    ranks = run_in_world(2, "tests.dist_worker:checks", tmp_path, (";".join(PARITY),), timeout=240)
    for scenario in PARITY:
        test_parity.test_matches_ddp_and_single_process((2, ranks), scenario)


def test_zero_is_ddp_bitwise_at_two_ranks(tmp_path):
    """``zero1``, ``zero2`` and ``zero3`` against DDP (bitwise) and one process (tests/test_zero.py)."""
    ranks = run_in_world(2, "tests.zero_worker:named", tmp_path, (";".join(ZERO),), timeout=240)
    test_zero.check_parity(2, ranks, list(ZERO))


def test_diloco_and_streaming_diloco_follow_the_papers_at_two_ranks(tmp_path):
    """``diloco`` and ``streaming_diloco`` against the papers' algorithms, step by step (tests/test_diloco.py)."""
    ranks = run_in_world(2, "tests.diloco_worker:checks", tmp_path, ("papers",), timeout=240)
    for mode in ("reference", "streaming"):
        test_diloco.test_every_replica_follows_the_papers_algorithm_step_by_step((2, ranks), mode)
