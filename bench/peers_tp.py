"""The tensor-parallel rows of ``bench/peers.py``: this project's step on a ("dp", "tp") mesh of 2 × 2 gloo ranks
against eager TP + FSDP2, as ``bench/tensor_parallel.py`` times them (torchtitan's plan with sequence parallel on
its TinyLlama, foreach AdamW), run by ``python -m bench.peers`` as a world of 4 after its world of 2 and written
as rows of the same table. Only the variants these rows need are built."""

from __future__ import annotations

import json
import os
import statistics

from bench.two_ranks import ROOT, two_rank_results

PEER = "eager TP + FSDP2"
MODES = ("fused_allreduce", "zero2", "zero3")
TITLE = (
    "TinyLlama under torchtitan's tensor-parallel plan (dim 64, 4 blocks; a world of 4: dp=2 × tp=2; "
    "ops, sent bytes and peak of one step, not four)"
)


def tp_world(port: int) -> list[dict]:
    """Every rank's timing record of ``bench/tensor_parallel.py`` for the peer and :data:`MODES`."""
    settings = {"timing": True, "train": 0, "warm": 0, "compile": False, "variants": [PEER, *MODES]}
    os.environ["TP_BENCH"] = json.dumps(settings)
    script = str(ROOT / "bench" / "tensor_parallel.py")
    return [r["timing"] for r in two_rank_results(script, lambda out, _: [out], port, world=4)]


def tp_rows(ranks: list[dict]) -> list[dict]:
    """``bench/peers.py``'s rows (see its ``world_rows``): ratio and ms per rank as there, then the slowest rank's;
    ops, bytes handed to collectives (both mesh dimensions) and memory rank 0's."""
    rows = []
    for mode in MODES:
        ratios = [statistics.median(a / b for a, b in zip(r[mode]["ms"], r[PEER]["ms"])) for r in ranks]
        ms = {
            key: max(statistics.median(r[label]["ms"]) for r in ranks)
            for key, label in (("ours", mode), ("peer", PEER))
        }
        sides = {key: _figures(ranks[0][label]) for key, label in (("ours", mode), ("peer", PEER))}
        rows.append({"labels": (f"TP + {mode}", PEER), "ratio": max(ratios), "ms": ms, **sides})
    return rows


def _figures(record: dict) -> dict:
    held = record["held"]
    return {
        "work": record["work"],
        "views": record["views"],
        "sent": sum(record["bytes"].values()),
        "held": held,
        "peak": held + record["rise"],
    }
