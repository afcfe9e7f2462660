"""Shaped links (``Host.shape`` in bench/harness/hosts.py) and a short run of ``bench/wan.py`` over them.

- A socket between two hosts sees the rate a link is given, each way, within 20% (TCP/IP headers take about 4.5%
  of it on veth's 1500-byte frames); unshaped, the same link carries gigabits.
- A step's collectives go through the shaping buckets: every byte a run's modes say they sent left its host's
  interface, the buckets counted all of it, and the interface sent at most 10% more (headers, the stop votes,
  torchft's heartbeats).
- Every rank's steps are kept (wall and CPU seconds, program), the same programs on both ranks, rank 0's the very
  timeline it reports, and the report sets the two DiLoCo runs side by side per round from them.
- This project's ``diloco`` and torchft's own ``DiLoCo`` (its Manager, a lighthouse, the same H, the same outer
  Nesterov SGD), from the same weights and data, give the same held-out losses after each sync, exactly: at W=2
  each sum has two terms, so gloo's order cannot matter (at W=4 it does: bench/wan.py finds them 1e-7 apart).

Cost: about 50 s on 2 cores (two hosts of one rank, started twice; three short runs at 200 Mbit/s).
"""

from __future__ import annotations

import json

import pytest

from bench.harness.hosts import Hosts, launch_workers, measure_mbit, namespaces_unavailable
from bench.wan import WORKER
from bench.wan_report import rank_table

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def test_a_shaped_link_carries_its_rate_each_way():
    with Hosts(2) as (a, b):
        free = measure_mbit(a, b, 20_000_000)
        a.shape(40)
        sent, received = measure_mbit(a, b, 2_500_000), measure_mbit(b, a, 2_500_000)
        a.shape(None)
        again = measure_mbit(a, b, 20_000_000)
    assert min(free, again) > 200, (free, again)  # the limit is the bucket's, and it goes with it
    for rate in (sent, received):  # a's end limits what it sends, the switch's end what it receives
        assert 0.8 * 40 <= rate <= 1.2 * 40, (sent, received)


@pytest.mark.timeout(300)
def test_a_short_shaped_run_sends_through_the_buckets_and_our_diloco_matches_torchfts(tmp_path):
    start, lines = tmp_path / "start.pt", tmp_path / "runs.jsonl"
    with Hosts(2, named=True) as hosts:
        launch_workers(
            hosts, WORKER, ["--warm", "--start", str(start), "--warmup-steps", "0"], tmp_path / "warm", 29621, 120
        )
        for host in hosts:
            host.shape(200)
        variants = ["DDP", "diloco H=15", "torchft DiLoCo H=15"]
        options = ["--out", str(lines), "--start", str(start), "--variants", *variants, "--budget", "2.5"]
        launch_workers(
            hosts, WORKER, [*options, "--ddp-steps", "15", "--ddp-budget", "60"], tmp_path / "run", 29622, 240
        )
        buckets = [host.link_bytes() for host in hosts]
    runs = {r["label"]: r for r in map(json.loads, lines.read_text().splitlines())}
    assert list(runs) == variants
    for rank, bucket in enumerate(buckets):
        said = sum(r["mode_sent"][rank] for r in runs.values())
        seen = sum(r["link_tx"][rank] for r in runs.values())
        assert said > 0 and seen >= said, (rank, seen, said)  # all of it left through this host's interface
        assert seen <= 1.10 * said + 2**20, (rank, seen, said)
        assert bucket["shaped_tx"] >= seen, (rank, bucket, seen)  # the host's bucket passed it
        assert bucket["shaped_rx"] >= said, (rank, bucket, said)  # and the switch's end, what the peer sent it
    for r in runs.values():
        assert len(r["ranks"]) == 2 and len(r["retransmitted"]) == 2, r.keys()
        assert [s[3] for s in r["ranks"][0]] == [s[3] for s in r["ranks"][1]], r["label"]
        assert [(s[1], s[3]) for s in r["ranks"][0]] == [(t[1], t[2]) for t in r["timeline"]], r["label"]
    table = rank_table([r | {"rate": 200} for r in runs.values()])
    assert [line.split(" | ")[1] for line in table[4:-1]] == variants[1:], table
    ours, theirs = runs["diloco H=15"]["series"], runs["torchft DiLoCo H=15"]["series"]
    common = min(len(ours), len(theirs))
    assert common >= 1 and [s[0] for s in ours[:common]] == [s[0] for s in theirs[:common]]
    assert [s[2] for s in ours[:common]] == [s[2] for s in theirs[:common]], (ours, theirs)
