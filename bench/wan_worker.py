"""One rank of ``bench/wan.py``, on a host of its own behind a shaped link: every variant in turn, from the same warm
start, each for a wall-clock budget, with the weights it would be evaluated on kept every ``EVERY`` steps.

The clock counts the steps only. Every ``EVERY`` steps it stops while the rank copies its weights (evaluated after
the run, so that evaluation takes no time from training) and while the ranks agree, on a group of their own, whether
the budget is spent (the slower rank's clock decides). An exchange in flight goes on moving while the clock stands:
those pauses are a few milliseconds every ``EVERY`` steps. Each variant's first step, which traces its programs, is
taken before the clock starts, and its time reported as ``setup_s`` (PowerSGD's first two: torch's hook all-reduces
plainly until its ``start_powerSGD_iter``, 2 at the least). Every rank's steps (start on the machine's clock, wall
and CPU seconds, program) and its host's TCP retransmissions go to rank 0 for the report's rank-by-rank table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.diloco import (
    DEMO,
    DEMO_LR,
    GLOBAL_WEIGHTS,
    LR,
    PER_RANK,
    STREAMING,
    corpus,
    held_out_loss,
    model_for,
    sent_bytes,
    warmed_up,
    windows,
)
from bench.peers_torchft import OUTER, torchft_manager
from transpiler import mode_config, transpile

ROOT = Path(__file__).resolve().parent.parent

EVERY = 15  # steps between kept weights (and stop votes): DiLoCo H=15's sync, where its model is θ_global
LIGHTHOUSE_PORT = 29590
VARIANTS = {  # label -> (kind, options); kind: "ddp", "torchft", or one of this project's modes
    "DDP": ("ddp", {}),
    "DDP + PowerSGD r=4": ("ddp", {"hook": "powersgd"}),
    "DDP + fp16": ("ddp", {"hook": "fp16"}),
    "diloco H=15": ("diloco", {"sync_every": 15}),
    "diloco H=15, 1 MiB buckets": ("diloco", {"sync_every": 15, "bucket_cap_mb": 1.0}),
    "diloco H=15, per tensor": ("diloco", {"sync_every": 15, "bucket_cap_mb": 0.0, "first_bucket_mb": 0.0}),
    "diloco H=50": ("diloco", {"sync_every": 50}),
    "streaming int4 tau=1": ("streaming_diloco", {**STREAMING, "exchange_dtype": "int4"}),
    "streaming int4 tau=0": ("streaming_diloco", {**STREAMING, "exchange_dtype": "int4", "fragment_sync_delay": 0}),
    "sparseloco": ("sparseloco", {}),  # the authors' 512M run: H=15, 128 of each 64 x 64 tile, 2-bit values
    "demo": ("demo", {**DEMO, "topk": 32}),  # the authors' DeMo: 32 of each 64 x 64 DCT tile
    "torchft DiLoCo H=15": ("torchft", {"sync_every": 15}),
}


class CountedAllReduce:
    """Counts what ``dist.all_reduce`` carries while ``on``: DDP's communication hooks call it from Python (DDP's
    own reducer does not), so this is what a hook says it sends."""

    def __init__(self) -> None:
        self.on, self.bytes, self.peak = False, 0, 0
        self.original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            if self.on:
                size = tensor.numel() * tensor.element_size()
                self.bytes, self.peak = self.bytes + size, max(self.peak, size)
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counted


def link_bytes() -> tuple[int, int]:
    """What this host's interface sent and received so far, headers included (the kernel's counters)."""
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def retransmitted() -> int:
    """TCP segments this host's namespace sent again so far (``/proc/net/snmp``'s ``RetransSegs``): what a full
    queue at a shaped link dropped."""
    header, values = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line[:4] == "Tcp:"]
    return int(values[header.index("RetransSegs")])


class Variant:
    """A variant's step, what it evaluates, and what it says it sent in its last step."""

    def __init__(self, label: str, model: nn.Module, counter: CountedAllReduce, lighthouse: str) -> None:
        self.kind, options = VARIANTS[label]
        self.model, self.counter, self.world = model, counter, dist.get_world_size()
        self.params = sum(p.numel() for p in model.parameters())
        if self.kind == "demo":  # sign steps, plain SGD (the authors'; bench/diloco.py)
            self.inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=DEMO_LR)
        else:
            self.inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        self.sync_every = options.get("sync_every")
        self.manager, self.taken = None, 0
        self.counts: dict[str, tuple[float, int]] = {}  # this project's program -> what it sends, its peak
        self.untimed = 2 if options.get("hook") == "powersgd" else 1  # steps before the clock: PowerSGD's 1st is plain
        if self.kind == "ddp":
            # PowerSGD's callbacks start all-reduces from gloo's thread: with DDP's default small first bucket the
            # ranks issue two buckets' all-reduces in different orders and gloo fails (sizes differ). DDP's own
            # cap, given explicitly, makes the first bucket as large as the rest: one bucket for this model.
            cap = {"bucket_cap_mb": 25} if options.get("hook") == "powersgd" else {}
            self.ddp = nn.parallel.DistributedDataParallel(model, **cap)
            if options.get("hook") == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2, random_seed=0
                )  # error feedback and warm start on, torch's defaults; compression from the 2nd step (its least)
                self.ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            elif options.get("hook") == "fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            self.hooked = "hook" in options
        elif self.kind == "torchft":
            self._torchft(lighthouse)
        else:
            self.step = transpile(model, self.inner, mode_config(self.kind, **options), loss_fn=nn.CrossEntropyLoss())

    def _torchft(self, lighthouse: str) -> None:
        """torchft's DiLoCo as its docs run it: a Manager per replica group (here a group of one rank per host)
        with a synchronous quorum, and the optimizer's post-step hook that syncs every H steps."""
        from torchft.local_sgd import DiLoCo

        self.store, self.manager = torchft_manager(os.environ["HOST_ADDRESS"], lighthouse, "wan")
        outer = torch.optim.SGD(self.model.parameters(), **OUTER)
        self.diloco = DiLoCo(self.manager, [self.model], self.inner, outer, sync_every=self.sync_every).__enter__()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> str:
        """One step; the name of the program it ran."""
        if self.kind not in ("ddp", "torchft"):
            self.step(x, y)
            return self.step.last_variant
        self.counter.on, self.counter.bytes, self.counter.peak = True, 0, 0
        self.inner.zero_grad()
        nn.functional.cross_entropy((self.ddp if self.kind == "ddp" else self.model)(x), y).backward()
        self.inner.step()  # torchft: its hook syncs at every H-th step
        self.counter.on, self.taken = False, self.taken + 1
        if self.kind == "ddp":
            return "step"
        return "sync" if self.taken % self.sync_every == 0 else "inner"

    def sent(self, program: str) -> tuple[float, int]:
        """What this rank says the step that ran ``program`` sent, and its largest message; read after the clock
        stopped (this project's programs are counted once each)."""
        ring = 2 * (self.world - 1) / self.world
        if self.kind == "ddp" and self.hooked:
            return ring * self.counter.bytes, self.counter.peak
        if self.kind == "ddp":  # the reducer all-reduces every gradient (its 25 MiB buckets hold the whole model)
            return ring * 4 * self.params, 4 * self.params
        if self.kind == "torchft":
            largest = max(p.numel() for p in self.model.parameters()) * 4  # it all-reduces each tensor alone
            return (ring * 4 * self.params if program == "sync" else 0.0), largest
        if program not in self.counts:
            self.counts[program] = sent_bytes(self.step.programs[program], self.world)
        return self.counts[program]

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights the papers evaluate: θ_global for this project's DiLoCo family, the model otherwise
        (torchft's right after a sync, where it is θ_global: kept every EVERY = H steps)."""
        if self.kind in GLOBAL_WEIGHTS:
            with self.step.global_weights() as evaluated:
                return {k: v.detach().clone() for k, v in evaluated.state_dict().items()}
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        if self.manager is not None:
            self.diloco.__exit__(None, None, None)
            self.manager.shutdown(wait=False)


def run(label: str, args: argparse.Namespace, data: tuple, start: dict, counter, control, lighthouse: str) -> dict:
    """Train ``label`` from ``start`` until its budget is spent (DDP: until ``--ddp-steps`` or its own budget)."""
    train, held, vocab = data
    rank = dist.get_rank()
    model = model_for(vocab, args.seed)
    model.load_state_dict(start)
    gen = torch.Generator().manual_seed(100 + 1000 * args.seed + rank)
    began = time.perf_counter()
    variant = Variant(label, model, counter, lighthouse)
    for _ in range(variant.untimed):  # traces this project's programs; the clock starts after
        variant(*windows(train, PER_RANK, gen))
    setup = time.perf_counter() - began
    steps, clock, sent, peak, kept, timeline, mine = variant.untimed, 0.0, 0.0, 0, [], [], []
    by_program: dict[str, list[float]] = {}
    is_ddp = label == "DDP"
    limit = args.ddp_budget if is_ddp else args.budget
    dist.barrier(group=control)
    tx0, rx0 = link_bytes()
    resent = retransmitted()
    while True:
        x, y = windows(train, PER_RANK, gen)
        tx = link_bytes()[0]
        begin, cpu = time.perf_counter(), time.process_time()
        ran = variant(x, y)
        took, cpu = time.perf_counter() - begin, time.process_time() - cpu
        (s, p), program = variant.sent(ran), ran.rstrip("0123456789")
        timeline.append((clock, took, program, link_bytes()[0] - tx))
        mine.append((begin, took, cpu, program))
        clock, steps, sent, peak = clock + took, steps + 1, sent + s, max(peak, p)
        by_program.setdefault(program, []).append(took)
        if steps % EVERY:
            continue
        kept.append((steps, clock, variant.weights()))
        spent = torch.tensor([clock])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=control)
        kept[-1] = (steps, float(spent), kept[-1][2])
        if float(spent) >= limit or (is_ddp and steps >= args.ddp_steps):
            break
    tx1, rx1 = link_bytes()
    variant.close()
    series = []
    if rank == 0:
        for at, when, weights in kept:
            model.load_state_dict(weights)
            series.append((at, when, held_out_loss(model, held)))
    per_rank = torch.tensor([tx1 - tx0, rx1 - rx0, sent, peak, retransmitted() - resent], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, per_rank, group=control)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine, group=control)
    return {
        "label": label,
        "steps": steps,
        "untimed": variant.untimed,
        "setup_s": setup,
        "series": series,
        "program_ms": {k: 1000 * statistics.median(v) for k, v in by_program.items()},
        "step_ms": 1000 * statistics.median(t for _, t, _, _ in timeline),
        "link_tx": [float(g[0]) for g in gathered],
        "link_rx": [float(g[1]) for g in gathered],
        "mode_sent": [float(g[2]) for g in gathered],
        "peak_message": max(float(g[3]) for g in gathered),
        "retransmitted": [int(g[4]) for g in gathered],
        "timeline": timeline,
        "ranks": ranks,  # every rank's steps: (begin on the machine's monotonic clock, wall s, CPU s, program)
        "params": variant.params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="a file: one JSON line per variant is added to it")
    parser.add_argument("--start", required=True, help="the warm start's weights (torch.save of a state dict)")
    parser.add_argument("--warm", action="store_true", help="only train the warm start (DDP) and save it")
    parser.add_argument("--warmup-steps", type=int, default=600)
    parser.add_argument("--variants", nargs="*", default=[])
    parser.add_argument("--budget", type=float, default=70.0)
    parser.add_argument("--ddp-steps", type=int, default=180)
    parser.add_argument("--ddp-budget", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    torch.set_num_threads(1)
    data = corpus()
    if args.warm:
        start = warmed_up(args.warmup_steps, data[0], data[2], args.seed, "narrow")
        if dist.get_rank() == 0:
            torch.save(start, args.start)
        dist.destroy_process_group()
        return
    start = torch.load(args.start)
    control = dist.new_group(backend="gloo")  # the stop votes, apart from the variants' own collectives
    lighthouse = f"http://{os.environ['MASTER_ADDR']}:{LIGHTHOUSE_PORT}"
    server = None
    if dist.get_rank() == 0 and any(VARIANTS[v][0] == "torchft" for v in args.variants):
        from torchft._torchft import LighthouseServer

        server = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=dist.get_world_size())
    counter = CountedAllReduce()
    for label in args.variants:
        result = run(label, args, data, start, counter, control, lighthouse)
        if dist.get_rank() == 0:
            with open(args.out, "a") as out:
                out.write(json.dumps(result) + "\n")
            print(f"{label}: {result['steps']} steps, {result['series'][-1]}", flush=True)
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
