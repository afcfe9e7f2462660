"""``transpiler plan`` and ``transpiler calibrate``: the planner from the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from transpiler.errors import ConfigurationError

from .calibrate import calibrate
from .cluster import Cluster, simple_cluster
from .search import OBJECTIVES, plan

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_commands(
    sub: argparse._SubParsersAction, load_factory: Callable[[str], tuple], load_callable: Callable[[str], tuple]
) -> None:
    """Add ``plan`` and ``calibrate`` to the CLI's subcommands; ``load_factory`` reads FILE.py:FACTORY and calls
    it, ``load_callable`` reads FILE.py:NAME."""
    planning = sub.add_parser(
        "plan",
        help="rank the layouts for a model on a cluster: mode, mesh, recompute, settings",
        description="Trace FACTORY's step once, price every layout on the cluster (a file from 'transpiler "
        "calibrate' or written by hand, or --hosts/--mbit/--memory-mib) and print them ranked, with those left "
        "out and why. Nothing runs distributed (docs/planner.md).",
    )
    planning.add_argument("factory", metavar="FILE.py:FACTORY", help="returns (model, optimizer, loss_fn, batch)")
    planning.add_argument("--cluster", metavar="FILE.json", help="the cluster (planner/cluster.py's JSON)")
    planning.add_argument("--hosts", type=int, help="without --cluster: hosts")
    planning.add_argument("--ranks-per-host", type=int, default=1, help="without --cluster: ranks on each host")
    planning.add_argument("--mbit", type=float, help="without --cluster: the link between hosts, Mbit/s")
    planning.add_argument("--memory-mib", type=float, help="memory per rank, MiB (overrides the file's)")
    planning.add_argument("--objective", choices=OBJECTIVES, default="time_to_target")
    planning.add_argument("--steps", type=int, help="the run's length: a compile's first call is spread over it")
    planning.add_argument("--json", metavar="FILE", help="also write the plan as JSON here")
    planning.add_argument(
        "--tp-plan",
        metavar="FILE.py:FUNCTION",
        help="FUNCTION(model) returns the model's tensor-parallel plan (parallelize_module's dict): the plan then "
        "also weighs tensor-parallel degrees within a host",
    )
    planning.set_defaults(func=lambda args: _plan(args, load_factory, load_callable))
    measuring = sub.add_parser(
        "calibrate",
        help="under torchrun: measure the links and the model's step, write a cluster file",
        description="Run on every host under torchrun (torchrun --nnodes H --nproc-per-node R -m transpiler.cli "
        "calibrate FILE.py:FACTORY -o cluster.json): times each collective at each link level and the model's "
        "step on every rank at once; rank 0 writes the cluster for 'transpiler plan --cluster'.",
    )
    measuring.add_argument("factory", metavar="FILE.py:FACTORY")
    measuring.add_argument("--memory-mib", type=float, required=True, help="memory each rank may use, MiB")
    measuring.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    measuring.add_argument(
        "--compile",
        action="store_true",
        help="on a GPU: also compile the program and time it (a minute or more), so plans may pick compile=True",
    )
    measuring.add_argument("--autocast", choices=sorted(AUTOCAST), help="time every step under autocast to this type")
    measuring.add_argument("-o", "--output", default="cluster.json")
    measuring.set_defaults(func=lambda args: _calibrate(args, load_factory))


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        cluster = Cluster.load(args.cluster)
        if args.memory_mib is not None:
            cluster = Cluster.from_dict({**cluster.to_dict(), "memory_per_rank_mib": args.memory_mib})
        return cluster
    if args.hosts is None or args.mbit is None or args.memory_mib is None:
        raise ConfigurationError("give --cluster FILE.json, or --hosts, --mbit and --memory-mib.")
    return simple_cluster(args.hosts, args.ranks_per_host, args.mbit, args.memory_mib)


def _plan(args: argparse.Namespace, load_factory: Callable[[str], tuple], load_callable: Callable) -> int:
    cluster = _cluster(args)
    model, optimizer, loss_fn, batch = load_factory(args.factory)
    tp_plan = load_callable(args.tp_plan)[0](model) if args.tp_plan else None
    print(f"planning for {cluster.world_size} ranks: tracing the step once...", file=sys.stderr)
    made = plan(
        model, optimizer, loss_fn, tuple(batch), cluster, objective=args.objective, steps=args.steps, tp_plan=tp_plan
    )
    sys.stdout.write(made.table())
    if args.json:
        Path(args.json).write_text(made.to_json() + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _calibrate(args: argparse.Namespace, load_factory: Callable[[str], tuple]) -> int:
    if args.compile and args.device != "cuda":
        raise ConfigurationError("--compile prices compile=True on a GPU: give --device cuda too.")
    autocast = AUTOCAST[args.autocast] if args.autocast else None
    cluster = calibrate(
        load_factory(args.factory), args.memory_mib, args.device, compile=args.compile, autocast=autocast
    )
    if cluster is not None:
        cluster.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
