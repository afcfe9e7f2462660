"""Several hosts (network namespaces joined by veth pairs, tests/hosts.py), each running its own torchrun with
the c10d rendezvous, against the same job on one host.

2 hosts × 2 processes give bitwise the parameters of 1 host × 4 on loopback for ``fused_allreduce``, ``zero2``
and hierarchical AdaSum (``local_size=2``, the processes of a host): the ranks' data, programs and gloo's
algorithms are the same, only the wire differs, so the reduction order is the same.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import ROOT, launch
from tests.hosts import Hosts, namespaces_unavailable, torchrun, wait_all

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def test_two_hosts_of_two_match_one_host_of_four_bitwise(tmp_path):
    one_host, two_hosts = tmp_path / "one", tmp_path / "two"
    one_host.mkdir(), two_hosts.mkdir()
    launch(ROOT / "tests" / "multihost_worker.py", 4, [str(one_host)], timeout=240)
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
    reference = [torch.load(one_host / f"rank{r}.pt") for r in range(4)]
    interfaces = {r["where"]["GLOO_SOCKET_IFNAME"] for r in ours}
    assert len(interfaces) == 2 and all(r["where"]["LOCAL_WORLD_SIZE"] == "2" for r in ours), [r["where"] for r in ours]
    for rank, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        for mode, params in theirs["params"].items():
            for name, value in params.items():
                assert torch.equal(mine["params"][mode][name], value), (rank, mode, name)
