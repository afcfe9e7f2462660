"""torch's gloo corrupts the heap when an all-gather runs beside another collective: a reproducer with torch alone.

Each run is a world of 2 on gloo over loopback that repeats the collective pattern of a ``zero1`` step on the
tiny GPT-2 of ``tests/zero_worker.py`` (18 buckets, 128 to 4,096 float32 values) with functional collectives
and nothing of this project. What differs between the patterns is only which collectives are in flight
together:

* ``together``: every bucket's all-gather is issued, then all are waited (the overlap ``schedule-collectives``
  gave them before);
* ``beside``: the reduce-scatters are in flight while each all-gather is issued and waited at once;
* ``alone``: each all-gather is issued with nothing else in flight and waited at once; the reduce-scatters
  are still all in flight together (what ``schedule-collectives`` emits for CPU tensors now);
* ``all_to_all``: as ``alone``, with each reduce-scatter made of an ``all_to_all_single`` and a local sum of
  the W chunks received (a cheaper reduce-scatter on gloo, docs/memory.md), all in flight together.

A run that dies (``malloc(): unaligned tcache chunk detected``, ``free(): invalid pointer``, SIGSEGV, or the
other rank's "Connection reset by peer") counts as crashed. Under gdb with glibc's malloc checks
(``LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3``) the invalid free is in ``ProcessGroupGloo::runLoop``
while gloo's TCP thread edits its pending-receive table.

    python -m bench.gloo_all_gather                 # 4 runs of 1,000 steps per pattern, about 6 minutes
    python -m bench.gloo_all_gather --runs 2 --steps 200
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

BUCKETS = [128, 4096, 128, 4096, 256, 1024, 128, 3072, 256, 4096, 128, 4096, 256, 1024, 128, 3072, 768, 3200]
PATTERNS = ("together", "beside", "alone", "all_to_all")


def rank_main(pattern: str, steps: int) -> None:
    """One rank: ``steps`` rounds of 18 reduce-scatters and 18 all-gathers in the given pattern."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        if pattern == "all_to_all":
            splits = [[n // world] * world for n in BUCKETS]
            sent = [c10d.all_to_all_single(torch.randn(n, generator=gen), s, s, group) for n, s in zip(BUCKETS, splits)]
            scattered = [c10d.wait_tensor(t).view(world, -1).sum(0) for t in sent]
        else:
            scattered = [
                c10d.reduce_scatter_tensor(torch.randn(n, generator=gen), "sum", world, group) for n in BUCKETS
            ]
        if pattern == "together":
            shards = [c10d.wait_tensor(s) * 0.5 for s in scattered]
            gathered = [c10d.all_gather_into_tensor(s, world, group) for s in shards]
            full = [c10d.wait_tensor(g) for g in gathered]
        elif pattern == "beside":
            full = [
                c10d.wait_tensor(c10d.all_gather_into_tensor(c10d.wait_tensor(s) * 0.5, world, group))
                for s in scattered
            ]
        else:
            shards = [(s if pattern == "all_to_all" else c10d.wait_tensor(s)) * 0.5 for s in scattered]
            full = [c10d.wait_tensor(c10d.all_gather_into_tensor(s, world, group)) for s in shards]
        assert [t.numel() for t in full] == BUCKETS
    dist.destroy_process_group()
    os._exit(0)  # gloo may abort in interpreter finalisation on this torch (docs/design.md)


def one_run(pattern: str, steps: int, timeout: float) -> str:
    """Launch a world of 2; 'clean', 'crashed' (a rank died) or 'hung'."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        cmd = [sys.executable, __file__, "--rank-of", pattern, "--steps", str(steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return "hung"
    return "clean" if codes == [0, 0] else "crashed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--rank-of", choices=PATTERNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(args.rank_of, args.steps)
    import torch

    print(f"torch {torch.__version__}, world of 2 on gloo, {args.steps} steps of 18 reduce-scatters + 18 all-gathers")
    print("| pattern | runs | crashed | hung |\n|---|---|---|---|")
    for pattern in args.patterns.split(","):
        results = [one_run(pattern, args.steps, timeout=60 + args.steps * 0.5) for _ in range(args.runs)]
        print(f"| {pattern} | {args.runs} | {results.count('crashed')} | {results.count('hung')} |", flush=True)


if __name__ == "__main__":
    main()
