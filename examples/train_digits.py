"""Train a classifier on scikit-learn's bundled digits data with a transpiled step.

    torchrun --nproc-per-node 2 examples/train_digits.py --mode fused_allreduce

Surviving a lost worker (docs/fault_tolerance.md): checkpoints every 5 steps, and torchrun restarts the workers,
which resume from the newest checkpoint; on one machine

    torchrun --standalone --nproc-per-node 2 --max-restarts 2 examples/train_digits.py --checkpoint-dir ckpt \
        --save-every 5

and across hosts, at whatever world size the restart has:

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        --rdzv-id digits examples/train_digits.py --mode fused_allreduce --checkpoint-dir /shared/ckpt --save-every 5

(The workers join with transpiler.init_distributed, which a restart's stale keys cannot mislead:
pytorch/pytorch#135712; no environment variable needed.)

Without restarting the survivors: replica groups under a torchft quorum (--fault-tolerance; start the
lighthouse first with `torchft_lighthouse --min_replicas 2`), one command per group, of one process or several
(each group then reduces inside itself, and across the groups on torchft's group):

    TORCHFT_LIGHTHOUSE=http://HOST:29510 REPLICA_GROUP_ID=g0 torchrun --nproc-per-node 1 --max-restarts 3 \
        --rdzv-backend c10d --rdzv-endpoint localhost:0 examples/train_digits.py --fault-tolerance --global-batch 32

Each rank trains on its own shard of every global batch; the transpiled graph
averages the gradients across ranks. Rank 0 shows progress and prints the
final test accuracy. Works with one process too (``python examples/train_digits.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from transpiler import (
    Checkpointer,
    DataPosition,
    Execution,
    FaultTolerance,
    ModeConfig,
    NoQuorumError,
    init_distributed,
    load_config,
    mode_config,
    transpile,
)
from transpiler.graph.options import key_values
from transpiler.strategies.modes import MODES

DEFAULT_LR = {  # learning rates that train this MLP on digits in 30 epochs
    "adam": 3e-3,
    "adamw": 3e-3,
    "nadam": 3e-3,
    "radam": 3e-3,
    "adamax": 3e-3,
    "rmsprop": 1e-3,
    "adagrad": 0.05,
    "adadelta": 1.0,
    "rprop": 1e-3,
    "adafactor": 1e-2,
    "asgd": 0.2,
    "sgd": 0.05,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="fused_allreduce", help=f"one of {', '.join(MODES)}, with -O")
    parser.add_argument(
        "--config", metavar="FILE.json", help="the mode's config as JSON (config.to_json()), -O on top; not --mode"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=128, help="samples per step over all ranks")
    parser.add_argument(
        "--lr", type=float, default=None, help="default: per optimizer, see DEFAULT_LR (1.0 with --mode dim_reduce)"
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(DEFAULT_LR),
        default=None,
        help="any of these torch.optim optimizers; default: adam (sgd with --mode dim_reduce)",
    )
    parser.add_argument("--momentum", type=float, default=None, help="for sgd; default 0.9 (0 with dim_reduce)")
    parser.add_argument("--init", metavar="PATH", help="start from these model weights (a --save-model file)")
    parser.add_argument("--save-model", metavar="PATH", help="rank 0 saves the trained model's weights here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hidden", type=int, default=128, help="the MLP's first hidden width, the second half of it (a longer step)"
    )
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save checkpoints here (every rank must see it) and resume from it"
    )
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints (--checkpoint-dir)")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept (--checkpoint-dir)")
    parser.add_argument(
        "--log-samples",
        metavar="DIR",
        help="each rank appends the sample ids and loss of every step to DIR/rank<r>.jsonl",
    )
    parser.add_argument("--timeout", type=float, default=120, help="process-group timeout in seconds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL")
    parser.add_argument(
        "--cuda-graph", action="store_true", help="capture the step as a CUDA graph (needs --device cuda)"
    )
    parser.add_argument("--compile", action="store_true", help="compile the step with torch.compile")
    parser.add_argument(
        "--fault-tolerance",
        action="store_true",
        help="this job is one replica group under a torchft quorum ($TORCHFT_LIGHTHOUSE, $REPLICA_GROUP_ID); "
        "--global-batch is then each group's batch (docs/fault_tolerance.md)",
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="with --fault-tolerance: fewest groups a step needs"
    )
    parser.add_argument(
        "--quorum-timeout",
        type=float,
        default=120,
        help="with --fault-tolerance: seconds to wait for a quorum of --min-replicas groups",
    )
    parser.add_argument(
        "--async-quorum",
        action="store_true",
        help="with --fault-tolerance: take each step's quorum while the step runs, and vote while it updates",
    )
    parser.add_argument(
        "--quorum-every",
        type=int,
        default=1,
        help="with --fault-tolerance: a quorum after every N committed steps, the steps between under the last one",
    )
    parser.add_argument(
        "--option",
        "-O",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the mode's config, e.g. -O k_steps=4 (local_sgd), -O sync_every=10 (diloco), "
        "-O pca_path=FILE (dim_reduce); a feature's dotted: -O accumulation.steps=4, -O loss_scaling.dynamic=true, "
        "-O clipping.max_norm=1, -O compression.wire_dtype=fp16, -O sparsification.ratio=0.05, "
        "-O freeze.groups=3 (with --optimizer sgd)",
    )
    parser.add_argument(
        "--save-trajectory", metavar="DIR", help="rank 0 saves the flattened weights here (transpiler pca)"
    )
    parser.add_argument("--trajectory-every", type=int, default=1, help="with --save-trajectory: every N updates")
    args = parser.parse_args(argv)
    args.config = config_of(args, parser)
    if args.cuda_graph and args.device != "cuda":
        parser.error("--cuda-graph captures the step on a GPU: add --device cuda")
    if args.fault_tolerance and args.checkpoint_dir:
        parser.error("--fault-tolerance heals a returning group from a live peer; drop --checkpoint-dir")
    return args


def config_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModeConfig:
    """The mode's config: ``--config FILE`` or ``--mode NAME``, with ``-O`` on top."""
    options = key_values(args.option)
    if "save_trajectory" in options:  # before issue 73 an -O; now an execution setting
        print("-O save_trajectory=DIR is now --save-trajectory DIR", file=sys.stderr)
        args.save_trajectory = options.pop("save_trajectory")
    if "trajectory_every" in options:
        print("-O trajectory_every=N is now --trajectory-every N", file=sys.stderr)
        args.trajectory_every = int(options.pop("trajectory_every"))
    if args.config is None:
        return mode_config(args.mode, **options)
    if args.mode != parser.get_default("mode"):
        parser.error("give --mode or --config, not both")
    return load_config(args.config, **options)


def load_data(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_train, x_test, y_train, y_test


def mlp(hidden: int = 128) -> torch.nn.Sequential:
    """The model: 64 pixels, two hidden layers (``hidden`` and half of it), 10 classes."""
    half = hidden // 2
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, half),
        torch.nn.ReLU(),
        torch.nn.Linear(half, 10),
    )


def main(argv: list[str] | None = None) -> None:
    """Train and evaluate with the command line ``argv`` (the script's own by default). Under torchrun it joins
    the world; called where a process group already exists, it trains in that one and leaves it as it was."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    own_group = not dist.is_initialized()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if args.device == "cuda" and own_group:  # NCCL, also for one process: a captured step needs it
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        init_distributed("nccl", args.timeout, device_id=device)
    elif (world > 1 or args.fault_tolerance) and own_group:  # safe across torchrun's restarts (docs/fault_tolerance.md)
        init_distributed("gloo", args.timeout)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(args.seed)  # every rank builds the same model; broadcast-params makes sure
    x_train, x_test, y_train, y_test = (t.to(device) for t in load_data(args.seed))
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {world}")
    per_rank = args.global_batch // world
    model = mlp(args.hidden)
    if args.init:
        model.load_state_dict(torch.load(args.init, weights_only=True))
    model.to(device)
    optimizer = make_optimizer(model, args)
    loss_fn = torch.nn.CrossEntropyLoss()
    # the same shuffle on every rank; under diloco each replica group reads the data in an order of its own
    own_order = args.fault_tolerance and args.config.mode == "diloco"
    seed = args.seed + (zlib.crc32(os.environ.get("REPLICA_GROUP_ID", "").encode()) if own_order else 0)
    position = DataPosition(len(x_train), args.global_batch, seed=seed)
    execution = Execution(
        compile=args.compile,
        cuda_graph=args.cuda_graph,
        save_trajectory=args.save_trajectory,
        trajectory_every=args.trajectory_every,
    )
    quorum = FaultTolerance(
        min_replicas=args.min_replicas,
        quorum_timeout=args.quorum_timeout,
        async_quorum=args.async_quorum,
        quorum_every=args.quorum_every,
    )
    batch = (x_train[:per_rank], y_train[:per_rank])
    step = transpile(
        model,
        optimizer,
        args.config,
        loss_fn,
        batch,
        fault_tolerance=quorum if args.fault_tolerance else None,
        execution=execution,
    )
    if rank == 0:
        counts = {
            variant: sum(1 for n in program.graph.nodes if "collective" in n.meta or "p2p" in n.meta)
            for variant, program in step.programs.items()
        }
        print(f"{args.config!r} world={world} per-rank batch={per_rank} communication ops per variant: {counts}")
    checkpointer = None
    if args.checkpoint_dir:
        checkpointer = Checkpointer(step, args.checkpoint_dir, every=args.save_every, keep=args.keep, position=position)
        resumed = checkpointer.resume()
        if rank == 0:
            where = f"resumed from {resumed} (epoch {position.epoch}, offset {position.offset})" if resumed else "fresh"
            print(f"{where}; checkpoints every {args.save_every} steps in {args.checkpoint_dir}", flush=True)
    group = os.environ.get("REPLICA_GROUP_ID") if args.fault_tolerance else None  # one log per group under a quorum
    log = SampleLog(args.log_samples, rank, world, group) if args.log_samples else None
    start = time.perf_counter()
    with Progress(
        TextColumn("[bold]epoch {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[metrics]}"),
        TimeElapsedColumn(),
        disable=rank != 0,
    ) as progress:
        task = progress.add_task("train", total=args.epochs, completed=position.epoch, loss=float("nan"), metrics="")
        steps_run = 0  # the log's step number where no quorum or checkpointer counts them
        try:
            while position.epoch < args.epochs:
                total, count = 0.0, 0
                for idx in batches(step, position, rank, world):
                    seat = step.quorum.seat if step.quorum is not None else None  # this step's quorum
                    loss = step(x_train[idx], y_train[idx]).item()
                    total, count, steps_run = total + loss, count + 1, steps_run + 1
                    if log is not None:
                        counted = checkpointer.steps + 1 if checkpointer else steps_run
                        number = seat.committed_steps + 1 if seat else counted
                        log.write(number, position, idx, loss, step.committed)
                    if checkpointer is not None:
                        checkpointer.step_done()
                metrics = " ".join(f"{k} {v:.4g}" for k, v in step.last_metrics.items())  # grad_norm, loss_scale...
                # a returning group's position jumps to its peers' when it heals
                progress.update(task, completed=position.epoch, loss=total / max(count, 1), metrics=metrics)
        except NoQuorumError as exc:
            if not (step.quorum.joined and position.batches_left(args.epochs) <= 1):
                raise
            # the run's last step found no quorum: the other groups have finished (under diloco, after their last
            # sync); this group's work is done, and its global weights are those of the last quorum it was in
            progress.stop()
            print(
                f"{str(exc).split(' (')[0]} at the run's last step; the other groups have ended, and this group's "
                "work is done.",
                flush=True,
            )
    model.eval()
    # DiLoCo evaluates the global weights, as the paper does; zero3 holds slices between steps, and every rank
    # enters step.gathered() (a no-op in the other modes)
    final_weights = step.global_weights() if step.outer_optimizer is not None else step.gathered()
    with final_weights, torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        train_loss = loss_fn(model(x_train), y_train).item()  # the final weights' loss on the whole training set
        if rank == 0 and args.save_model:
            os.makedirs(os.path.dirname(os.path.abspath(args.save_model)), exist_ok=True)
            torch.save(model.state_dict(), args.save_model)
    if rank == 0:
        seconds = time.perf_counter() - start
        print(
            f"trained {args.epochs} epochs in {seconds:.1f}s; train loss {train_loss:.4f}; test accuracy {accuracy:.4f}"
        )
    if own_group and dist.is_initialized():
        dist.destroy_process_group()


def batches(step, position: DataPosition, rank: int, world: int):
    """This rank's sample indices for each step of the current epoch: its share of every global batch, or, under a
    quorum, this group's share of each step's samples (taken again by the next step if one does not commit; under
    diloco from the group's own order), from a position that a returning group heals from a peer."""
    if step.quorum is None:
        yield from position.epoch_batches(rank, world)
        return
    epoch = position.epoch
    while position.epoch == epoch:
        indices = step.next_batch(position)
        if position.epoch != epoch:  # the step starts the next epoch, or this group healed to its peers' position
            return
        yield indices


class SampleLog:
    """Each step's sample ids on this rank, one JSON line per step, with the attempt they ran in (rank 0's start
    time, the same on every rank: torchrun's restart count is each agent's own, and an agent restarted for a
    membership change does not count it): what the tests check for samples lost or repeated across restarts."""

    def __init__(self, directory: str, rank: int, world: int, group: str | None = None) -> None:
        os.makedirs(directory, exist_ok=True)
        name = f"{group}-rank{rank}" if group else f"rank{rank}"
        self.file = open(os.path.join(directory, f"{name}.jsonl"), "a")  # noqa: SIM115 (open for the run)
        self.rank, self.world = rank, world
        box = [time.time()]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        self.attempt = box[0]

    def write(self, step: int | None, position: DataPosition, idx: torch.Tensor, loss: float, committed: bool) -> None:
        """One step: its samples and this rank's loss (JSON keeps a float's every bit), and whether it committed
        (under a quorum; always otherwise)."""
        record = {"attempt": self.attempt, "world": self.world, "rank": self.rank, "pid": os.getpid(), "step": step}
        record.update(time=time.time(), committed=committed)
        record.update(epoch=position.epoch, offset=position.offset, ids=idx.tolist(), loss=loss)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Adam by default, any torch.optim optimizer by name; DimReduce takes plain SGD with lr 1, as MindSpore
    Boost swaps in."""
    dim_reduce = args.config.mode == "dim_reduce"
    name = args.optimizer or ("sgd" if dim_reduce else "adam")
    lr = args.lr or (1.0 if dim_reduce else DEFAULT_LR[name])
    if name == "sgd":
        momentum = args.momentum if args.momentum is not None else (0.0 if dim_reduce else 0.9)
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    kind = next(getattr(torch.optim, n) for n in dir(torch.optim) if n.lower() == name)
    return kind(model.parameters(), lr=lr)


if __name__ == "__main__":
    main()
