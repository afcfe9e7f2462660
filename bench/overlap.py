"""How much of each bucket's all-reduce overlaps the rest of the step? Measured per bucket, per rank.

    torchrun --nproc-per-node 2 bench/overlap.py      # prints a table (rank 0)

The fused step is run through an fx Interpreter that stamps the clock when each all-reduce is issued,
when its wait starts and when the wait returns. While a bucket is in flight (issue to wait return) the
main thread either computes (issue to wait start: the part that overlaps) or blocks (the wait). Gradients
are bucketed in the order the backward produces them, and ``schedule-collectives`` issues each bucket
right after its last gradient, so the first bucket issued holds the first gradients produced.
Interpreting node by node adds Python overhead to the compute between stamps, so absolute times are
larger than the compiled-code step's; the split between overlapping and blocking is what this reports.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.fx as fx

from bench.limit import WORKLOADS
from transpiler import mode_config, transpile
from transpiler.graph.collectives import is_collective, is_wait
from transpiler.runtime import feed

CAPS = {"default caps (25 MiB, first 1 MiB)": {}, "1 MiB caps": {"bucket_cap_mb": 1.0}}
RUNS = 8


class Stamps(fx.Interpreter):
    """Runs a graph and records, per collective node, issue time, wait start and wait end."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.times: dict[str, list[float]] = {}

    def run_node(self, node: fx.Node):
        if is_wait(node):
            source = node.args[0].name
            self.times[source].append(time.perf_counter())
            out = super().run_node(node)
            self.times[source].append(time.perf_counter())
            return out
        out = super().run_node(node)
        if is_collective(node):
            self.times[node.name] = [time.perf_counter()]
        return out


def measure(step, batch) -> list[tuple[str, int, float, float]]:
    """Per bucket: name, bytes, median ms in flight, median share of that time overlapped with compute."""
    program = step.program
    built = step.prepare(batch)
    variant = next(v for v, p in built.programs.items() if p is program)
    buckets = {n.name: n.meta["collective"].get("bytes", 0) for n in program.graph.nodes if is_collective(n)}
    flight: dict[str, list[float]] = {name: [] for name in buckets}
    share: dict[str, list[float]] = {name: [] for name in buckets}
    for _ in range(RUNS):
        interpreter = Stamps(program.graph_module)
        dist.barrier()
        interpreter.run(*feed.inputs(step._state, program, built, batch, variant))
        for name, (issued, waiting, done) in interpreter.times.items():
            flight[name].append(done - issued)
            share[name].append((waiting - issued) / max(done - issued, 1e-9))
    return [(n, buckets[n], statistics.median(flight[n]) * 1e3, statistics.median(share[n])) for n in buckets]


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = []
    for name in ("MLP 1024-2048-1024-10, batch 64", "transformer 8 blocks d=128, 16x32 tokens"):
        build, make_batch = WORKLOADS[name]
        for caps, options in CAPS.items():
            torch.manual_seed(0)
            model = build()
            batch = make_batch(torch.Generator().manual_seed(rank))
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            step = transpile(model, opt, mode_config("fused_allreduce", **options), torch.nn.CrossEntropyLoss(), batch)
            for _ in range(3):
                step(*batch)
            for i, (_, size, ms, overlapped) in enumerate(measure(step, batch)):
                rows.append(f"| {name} | {caps} | {i} | {size / 2**20:.2f} | {ms:.1f} | {overlapped:.0%} |")
    if rank == 0:
        print("| workload | buckets | bucket (issue order) | MiB | in flight (ms) | overlapped with compute |")
        print("|---|---|---:|---:|---:|---:|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
