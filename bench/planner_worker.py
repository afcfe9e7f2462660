"""One rank of ``bench/planner.py``, on a host of its own behind a shaped link (the llama's: four ranks on one
host): calibrate, plan, then run every candidate the plan ranked (at an unbounded memory budget: the budgets are
applied afterwards, to the predicted and the measured figures alike) and write what each cost.

Per candidate: a fresh model and optimizer from the same seed, built with ``transpile(model, optimizer,
candidate, ...)`` (one ``TraceCache`` for the modes that take one; a tensor-parallel pick's plan applied first),
warmed up through two rounds of its schedule (every program traced), then timed over whole rounds (DiLoCo's H
steps, Streaming DiLoCo's 50, one step for the others), at least ``--steps`` steps and, where they take less,
as many such windows as last ``MIN_WINDOW_S`` (``MAX_ROUNDS`` at most): the slowest rank's wall time over each
window, after a barrier, summed and divided by the steps. The barrier and the timings' all-reduce run on a group
of their own, so an exchange the program leaves in flight (Streaming DiLoCo's) stays in flight across them, as
it would between two steps. Its memory is the built programs' own count
(``step.memory_estimate``, the largest over its variants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from bench.diloco import corpus, model_for, windows
from bench.models import TinyLlama, llama_tp_plan, next_token_loss
from transpiler import TraceCache, transpile
from transpiler.planner.calibrate import calibrate
from transpiler.planner.costs import STEPS_FACTORS
from transpiler.planner.profile import profile_step
from transpiler.planner.search import agreed, rank
from transpiler.runtime.global_weights import land_in_flight

PER_RANK = 8  # sequences of 64 characters per rank and step (bench/wan.py's)
LLAMA_VOCAB = 512


class WideMLP(nn.Module):
    """Few wide layers: 1.8M parameters in 6 tensors (the GPT's count in 149), a batch of 32 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU())
        self.head = nn.Linear(1024, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def factory(name: str, seed: int = 0) -> tuple:
    """(model, optimizer, loss_fn, batch maker) of a bench model; the maker takes a generator and a batch factor."""
    torch.manual_seed(seed)
    if name == "gpt":
        train, _, vocab = corpus()
        model = model_for(vocab, seed)
        return (
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            nn.CrossEntropyLoss(),
            (lambda gen, k: windows(train, PER_RANK * k, gen)),
        )
    if name == "llama":
        model = TinyLlama(vocab=LLAMA_VOCAB, dim=256, heads=4, hidden=1024, blocks=2)
        return (
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            next_token_loss,
            (lambda gen, k: (torch.randint(0, LLAMA_VOCAB, (8 * k, 64), generator=gen),) * 2),
        )
    model = WideMLP()
    return (
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        nn.MSELoss(),
        (lambda gen, k: (torch.randn(32 * k, 256, generator=gen), torch.randn(32 * k, 512, generator=gen))),
    )


def tp_plan_of(name: str, model: nn.Module) -> dict | None:
    """The bench model's tensor-parallel plan: torchtitan's for the llama (sequence parallel), none for the rest."""
    return llama_tp_plan(model, sequence_parallel=True) if name == "llama" else None


# a window shorter than this is timed again: one round of the MLP's Streaming DiLoCo (50 steps, 1.8 s at 20
# Mbit/s) measured 36–44 ms a step from run to run, its largest fragment's exchange alone 0.45–0.64 s
MIN_WINDOW_S = 5.0
MAX_ROUNDS = 8


def round_of(candidate) -> int:
    """Steps in one round of the candidate's schedule: a whole number of them is timed."""
    mode = candidate.config.mode
    if mode == "streaming_diloco":
        return 50  # every fragment's exchange and apply once
    return candidate.config.sync_every if mode in ("diloco", "sparseloco") else 1


def measure(candidate, name: str, steps: int, cache: TraceCache, timing: dist.ProcessGroup) -> dict:
    model, optimizer, loss_fn, make = factory(name)
    tp = candidate.layout.tp
    gen = torch.Generator().manual_seed(100 + dist.get_rank() // tp)  # a tensor-parallel group's ranks: one batch
    factor = candidate.layout.pp * tp
    batch = make(gen, factor)
    began = time.perf_counter()
    kwargs = {} if candidate.pipeline is not None or tp > 1 else {"trace": cache}
    if tp > 1:  # the plan applied over the pick's mesh, and the optimizer built on the shards, as docs/planner.md
        kwargs["mesh"] = candidate.apply_tensor_parallel(model, tp_plan_of(name, model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer.defaults["lr"])  # every bench model's
    step = transpile(model, optimizer, candidate, loss_fn, batch, **kwargs)
    period = round_of(candidate)
    for _ in range(2 * period if period > 1 else 2):  # two rounds: every variant built (Streaming's last apply
        # comes one step after the first round)
        step(*make(gen, factor))
    setup = time.perf_counter() - began
    count = period * math.ceil(steps / period)
    dist.barrier(group=timing)
    window, rounds = 0.0, 0
    while rounds < MAX_ROUNDS and (rounds == 0 or window < MIN_WINDOW_S):  # every rank decides on the same window
        batches = [make(gen, factor) for _ in range(count)]
        start = time.perf_counter()
        for b in batches:
            step(*b)
        spent = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=timing)  # the slowest rank's
        window, rounds = window + spent.item(), rounds + 1
    land_in_flight(step.extra)  # an exchange left in flight (Streaming DiLoCo's) ends here, not in the next candidate
    dist.barrier()
    peak = max(step.memory_estimate(v).peak for v in step.programs)
    held = torch.tensor([float(peak)])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return {
        "measured_step": window / (count * rounds),
        "measured_peak": int(held.item()),
        "setup_s": setup,
        "steps": count * rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt", "mlp", "llama"), required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", type=int, default=0, help="run only the first N candidates (0: all)")
    parser.add_argument("--labels", nargs="*", default=[], help="run only the candidates of these labels")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    began = time.perf_counter()
    model, optimizer, loss_fn, make = factory(args.model)
    cluster = calibrate((model, optimizer, loss_fn, make(torch.Generator(), 1)), 1 << 20)
    calibration_s = time.perf_counter() - began
    shared = [cluster]
    dist.broadcast_object_list(shared, src=0)
    cluster = shared[0]
    model, optimizer, loss_fn, make = factory(args.model)
    began = time.perf_counter()
    plan_tp = tp_plan_of(args.model, model)
    profile = agreed(
        lambda: profile_step(model, optimizer, loss_fn, make(torch.Generator(), 1), cluster.compute, tp_plan=plan_tp)
    )
    made = rank(profile, cluster, optimizer, "time_to_target", STEPS_FACTORS, began)
    planning_s = time.perf_counter() - began
    cache, timing = TraceCache(), dist.new_group(timeout=timedelta(seconds=300))
    rows = []
    for i, candidate in enumerate(made.ranked[: args.only or None]):
        if args.labels and candidate.label not in args.labels:
            continue
        e = candidate.estimate
        row = {
            "label": candidate.label,
            "mode": candidate.config.mode,
            "pp": candidate.layout.pp,
            "predicted_step": e.step,
            "predicted_compute": e.compute,
            "predicted_communication": e.communication,
            "predicted_peak": e.peak,
            "steps_factor": e.steps_factor,
            "predicted_rank": i,
        }
        try:
            row |= measure(candidate, args.model, args.steps, cache, timing)
        except Exception as error:  # a candidate that fails to run is a finding, not the end of the scenario
            row["error"] = f"{type(error).__name__}: {error}"[:500]
            print(f"rank {dist.get_rank()}: {candidate.label}: {row['error']}", file=sys.stderr, flush=True)
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        rejected = [{"label": r.label, "reason": r.reason} for r in made.rejected]
        summary = {"calibration_s": calibration_s, "planning_s": planning_s, "cluster": cluster.to_dict()}
        summary["profile"] = dataclasses.asdict(profile)  # the report prices the candidates again from it
        summary["profile"].pop("tensor_parallel")  # the report reads the plan against the model again
        with open(args.out, "w") as out:
            json.dump({"rows": rows, "rejected": rejected, **summary}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
