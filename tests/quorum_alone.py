"""One replica group alone under a torchft quorum against the same mode without one, step by step: the GPU lane
runs it on NCCL (tests/test_gpu.py), the CPU suite on a gloo world bound to a device (tests/test_quorum.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from bench.harness.launch import ROOT, free_port
from bench.tiny_models import make_batch, make_model
from transpiler import FaultTolerance, mode_config, transpile


def lighthouse(port: int) -> subprocess.Popen:
    """torchft's lighthouse in an interpreter of its own (``bench/harness/lighthouse.py``), not a fork: a test that
    kills it finds it gone at once."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "harness" / "lighthouse.py"),
        "--min_replicas",
        "1",
        "--bind",
        f"[::]:{port}",
    ]
    command += ["--join_timeout_ms", "200", "--heartbeat_timeout_ms", "1000"]
    return subprocess.Popen(command, env=dict(os.environ, RUST_LOG="warn"))


def one_group_against_plain(device: torch.device, modes: tuple[str, ...], steps: int = 8) -> dict[str, float]:
    """One replica group under a torchft quorum (its process group across groups is torchft's ``ProcessGroupNCCL``
    on a CUDA world) against the same mode without one, step by step: the largest difference of the losses and
    weights per mode, each step committed, and the quorum's size fed as the ``participants`` input."""
    port = free_port()
    server = lighthouse(port)
    worst = {}
    try:
        for mode in modes:
            options = {"diloco": {"sync_every": 3}, "streaming_diloco": {"sync_every": 3, "fragments": 2}}.get(mode, {})
            steps_by_kind = {}
            for kind in ("quorum", "plain"):
                torch.manual_seed(0)
                model = make_model("mlp").to(device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
                ft = FaultTolerance(f"http://localhost:{port}", f"alone-{mode}", timeout=30, quorum_timeout=60)
                example = tuple(t.to(device) for t in make_batch("mlp", 16, torch.Generator().manual_seed(1)))
                quorum = ft if kind == "quorum" else None
                config = mode_config(mode, **options)
                step = transpile(model, opt, config, nn.CrossEntropyLoss(), example, fault_tolerance=quorum)
                steps_by_kind[kind] = (model, step)
            gen, diff = torch.Generator().manual_seed(1), 0.0
            for _ in range(steps):
                batch = tuple(t.to(device) for t in make_batch("mlp", 16, gen))
                losses = {kind: step(*batch) for kind, (_, step) in steps_by_kind.items()}
                assert steps_by_kind["quorum"][1].committed
                weights = [list(model.parameters()) for model, _ in steps_by_kind.values()]
                diff = max(diff, (losses["quorum"] - losses["plain"]).abs().item())
                diff = max(diff, *((a - b).abs().max().item() for a, b in zip(*weights)))
            quorum = steps_by_kind["quorum"][1].quorum
            assert quorum.last_seat is not None and quorum.last_seat.participants == 1
            assert type(quorum.group).__name__ == ("ProcessGroupNCCL" if device.type == "cuda" else "ProcessGroupGloo")
            quorum.shutdown()
            worst[mode] = diff
    finally:
        server.kill()
        server.wait(timeout=30)
    return worst
