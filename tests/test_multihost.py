"""Several hosts (network namespaces joined by veth pairs, bench/harness/hosts.py), each running its own torchrun with
the c10d rendezvous, against the same job on one host.

2 hosts × 2 processes give bitwise the parameters of 1 host × 4 on loopback for ``fused_allreduce``, ``zero2``
and hierarchical AdaSum (``local_size=2``, the processes of a host): the ranks' data, programs and gloo's
algorithms are the same, only the wire differs, so the reduction order is the same.
"""

from __future__ import annotations

import re

import pytest
import torch

from bench.harness.hosts import Hosts, namespaces_unavailable, torchrun, wait_all
from bench.harness.launch import ROOT
from tests.worlds import run_in_world

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def test_two_hosts_of_two_match_one_host_of_four_bitwise(tmp_path):
    one_host, two_hosts = tmp_path / "one", tmp_path / "two"
    one_host.mkdir(), two_hosts.mkdir()
    reference = run_in_world(4, "tests.multihost_worker:checks", one_host)  # one host: the session's world of four
    with Hosts(2) as hosts:
        endpoint = f"{hosts[0].address}:29411"
        agents = [
            torchrun(
                host,
                str(ROOT / "tests" / "multihost_worker.py"),
                [str(two_hosts)],
                nnodes="2",
                nproc=2,
                endpoint=endpoint,
                run_id="parity",
                log=tmp_path / f"host{i}.log",
            )
            for i, host in enumerate(hosts)
        ]
        codes = wait_all(agents, timeout=240)
    logs = "\n".join((tmp_path / f"host{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], logs
    ours = [torch.load(two_hosts / f"rank{r}.pt") for r in range(4)]
    interfaces = {r["where"]["GLOO_SOCKET_IFNAME"] for r in ours}
    assert len(interfaces) == 2 and all(r["where"]["LOCAL_WORLD_SIZE"] == "2" for r in ours), [r["where"] for r in ours]
    for rank, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        for mode, params in theirs["params"].items():
            for name, value in params.items():
                assert torch.equal(mine["params"][mode][name], value), (rank, mode, name)


@pytest.mark.parametrize(
    "differs,error",
    [
        (["--mode", "zero2"], "RankMismatchError"),  # another mode (other options: the same check, test_safety_world)
        (["--checkpoint-dir", "{tmp}/elsewhere"], "CheckpointError"),  # another checkpoint
    ],
    ids=["mode", "checkpoint"],
)
def test_a_host_restarted_with_other_arguments_is_refused_on_every_rank(tmp_path, differs, error):
    """Host 1 comes back with another mode or another checkpoint directory than host 0: every
    rank of both hosts raises the same typed error before training (the startup handshake; the Checkpointer's
    agreement on what to resume), instead of a silently mixed world."""
    example = str(ROOT / "examples" / "train_digits.py")
    common = ["--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "5"]
    differs = [a.replace("{tmp}", str(tmp_path)) for a in differs]
    with Hosts(2) as hosts:
        agents = [
            torchrun(
                host,
                example,
                common + (differs if i == 1 else []),
                nnodes="2",
                nproc=2,
                endpoint=f"{hosts[0].address}:29413",
                run_id="mismatch",
                log=tmp_path / f"host{i}.log",
            )
            for i, host in enumerate(hosts)
        ]
        codes = wait_all(agents, timeout=180)
    output = "\n".join((tmp_path / f"host{i}.log").read_text() for i in range(2))
    assert all(code != 0 for code in codes), output[-3000:]
    for rank in range(4):
        assert re.search(rf"\[rank{rank}\]:.*{error}", output), (rank, output[-3000:])
    assert "test accuracy" not in output
