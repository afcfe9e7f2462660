"""One replica group of the fault-tolerance tests (tests/test_quorum.py): a torchrun job (one rank; two under
``diloco``) that trains
under a torchft quorum, logs every step it runs (committed or not) and, at the end, saves its state.

``python -m torch.distributed.run --nproc-per-node 1 ... tests/quorum_worker.py OUT GROUP --lighthouse ADDR``.
With ``--die-at K`` the group's first life ends (``os._exit``) at the first step on or after committed step K,
once the quorum for that step has formed, so that the other groups' collectives fail mid-step. With
``--refuse-at K`` the group votes against committed step K (once): it reports an error to torchft after the
quorum, runs the step, and saves its state before and after (``refused.pt``); the others commit without it, and
at the next quorum it is behind and heals from a peer, in the same process. With ``--slow-heal S`` every fetch of a
peer's state over torchft's checkpoint transport starts S seconds late (a slow link, or a loaded machine).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from bench.tiny_models import MLP
from transpiler import DataPosition, FaultTolerance, init_distributed, mode_config, transpile

SAMPLES, PER_GROUP = 96, 4  # a step of 3 groups takes 12 samples: 8 steps an epoch
SYNC_EVERY = 4  # DiLoCo's H
FRAGMENTS = 2  # Streaming DiLoCo's P
TWO_PARTICIPANT_STEPS = 10  # a group that died comes back only after the others committed this many without it
WAIT_LIMIT = 240.0  # seconds a worker waits on the other groups (longer than any test's): then it fails, saying why
LOSS = torch.nn.functional.cross_entropy
T = TypeVar("T")


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 20, generator=generator), torch.randint(0, 5, (SAMPLES,), generator=generator)


def fresh() -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, position: DataPosition) -> dict:
    """Copies of everything a step may change."""
    return copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "position": position.state_dict()}
    )


def whole_snapshot(step, position: DataPosition) -> dict:
    """:func:`snapshot` with whole parameters: under ``zero3`` each rank holds its slices between steps, and every
    rank of the group gathers them here (the optimizer's state stays in slices)."""
    with step.gathered(writeback=False):
        return snapshot(step.model, step.optimizer, position)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("group")
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--min-steps", type=int, default=12)
    parser.add_argument(
        "--together", type=int, default=1, help="diloco: end after this many syncs in a row with every group"
    )
    parser.add_argument("--groups", type=int, default=3, help="the groups of the last quorum: it ends the run")
    parser.add_argument("--first-groups", type=int, default=3, help="the groups that start together")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--refuse-at", type=int, default=-1)
    parser.add_argument(
        "--hold-at",
        type=int,
        default=-1,
        help="at committed step K, after the quorum: write OUT/held, wait for OUT/cut",
    )
    modes = ("fused_allreduce", "zero2", "zero3", "diloco", "streaming_diloco")
    parser.add_argument("--mode", choices=modes, default="fused_allreduce")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--sync-quorum", action="store_true", help="each quorum before its step (else beside it)")
    parser.add_argument("--quorum-every", type=int, default=1, help="FaultTolerance.quorum_every")
    parser.add_argument("--timeout", type=float, default=10, help="FaultTolerance.timeout, seconds")
    parser.add_argument("--slow-heal", type=float, default=0.0, help="seconds each fetch of a peer's state waits")
    args = parser.parse_args()
    if args.slow_heal:
        _slow_heal(args.slow_heal)
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker waits, into its group's log
    init_distributed("gloo", 60)  # each restart of a group of two forms its group afresh (join_world.py)
    (diloco if args.mode.endswith("diloco") else data_parallel)(args, life)
    dist.destroy_process_group()


def _slow_heal(seconds: float) -> None:
    """Every fetch of a peer's state over torchft's HTTP checkpoint transport starts ``seconds`` late."""
    from torchft.checkpointing.http_transport import HTTPTransport

    fetch = HTTPTransport.recv_checkpoint

    def late_fetch(self, *args, **kwargs):
        time.sleep(seconds)
        return fetch(self, *args, **kwargs)

    HTTPTransport.recv_checkpoint = late_fetch


def _setting(args: argparse.Namespace) -> FaultTolerance:
    return FaultTolerance(
        args.lighthouse,
        args.group,
        min_replicas=args.min_replicas,
        timeout=args.timeout,
        quorum_timeout=60,
        async_quorum=not args.mode.endswith("diloco") and not args.sync_quorum,  # beside the step, where it can be
        quorum_every=args.quorum_every,
    )


def _file(args: argparse.Namespace, suffix: str) -> Path:
    """This rank's file: ``GROUP<suffix>`` in a group of one rank, ``GROUP-rRANK<suffix>`` in a larger one."""
    rank = f"-r{dist.get_rank()}" if dist.get_world_size() > 1 else ""
    return args.out / f"{args.group}{rank}{suffix}"


def _until(ready: Callable[[], T], what: str, every: float) -> T:
    """``ready()`` once it is true, asked every ``every`` seconds; a TimeoutError naming ``what`` after
    :data:`WAIT_LIMIT`, so that a worker whose test is gone (killed with its session) does not poll for ever."""
    deadline = time.monotonic() + WAIT_LIMIT
    while not (value := ready()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_LIMIT:g} s for {what}")
        time.sleep(every)
    return value


def _first_groups_up(args: argparse.Namespace, life: int) -> None:
    """The first quorum holds the first groups (their managers heartbeat from transpile on), whatever the load."""
    if life == 0:
        (args.out / f"ready_{args.group}_{dist.get_rank()}").touch()
        expected = args.first_groups * dist.get_world_size()
        _until(lambda: len(list(args.out.glob("ready_*"))) >= expected, "the first groups' ranks", 0.05)


def _wait_for_steps_without(args: argparse.Namespace, steps: int) -> None:
    """Until another group's log shows ``steps`` steps (DiLoCo: syncs) committed with one participant fewer than the
    first groups."""

    def shown() -> bool:
        fewer = args.first_groups - 1
        return any(
            sum(r["committed"] and r.get("participants") == fewer for r in lines) >= steps for lines in _logs(args)
        )

    _until(shown, f"{steps} steps committed without this group", 0.05)


def _logs(args: argparse.Namespace) -> list[list[dict]]:
    """Every group's log so far (each rank's, outside DiLoCo), less a line still being written."""
    return [
        [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        for path in args.out.glob("g*.jsonl")
    ]


def _together(args: argparse.Namespace, sync: int) -> int:
    """The committed syncs in a row up to ``sync`` that every group took part in, read from every group's log once
    each has logged ``sync``. Every rank of every group that took part in ``sync`` reads the same answer, so all
    end at the same sync; a group's own count would differ from the others' when it returned mid-streak."""

    def logged() -> list[list[dict]]:
        logs = _logs(args)
        return logs if len(logs) == args.groups and all(any(r.get("step") == sync for r in log) for log in logs) else []

    logs = _until(logged, f"every group's log of sync {sync}", 0.02)
    full = {r["step"] for log in logs for r in log if r.get("committed") and r.get("participants") == args.groups}
    count = 0
    while sync - count in full:
        count += 1
    return count


def data_parallel(args: argparse.Namespace, life: int) -> None:
    """Data parallel across groups: ``fused_allreduce`` in groups of one rank or of several, or ``zero2`` in groups
    of several (each rank its share of the group's batch; the gradients all-reduced or reduce-scattered in the
    group, each bucket or shard then summed across the groups). ``--die-at K``: the group's last rank ends its
    first life mid-step at committed step K."""
    x, y = dataset()
    model, optimizer = fresh()
    if life > 0:  # back after a death only once the others have gone on without this group, whatever the load;
        # and before its manager heartbeats: torchft's lighthouse forms no quorum unless more than half of the
        # groups it hears from ask for one, so a group of two would wait for this one for ever
        _wait_for_steps_without(args, TWO_PARTICIPANT_STEPS)
    # zero3 needs the example batch: a rank heals its slices of the parameters before its first step
    step = transpile(model, optimizer, args.mode, LOSS, (x[:PER_GROUP], y[:PER_GROUP]), fault_tolerance=_setting(args))
    rank, world = dist.get_rank(), dist.get_world_size()
    position = DataPosition(SAMPLES, PER_GROUP * world, seed=1)
    _first_groups_up(args, life)
    log = _file(args, ".jsonl").open("a")
    trajectory: dict[int, dict] = {}  # committed step -> the state after it
    while True:
        indices = step.next_batch(position)
        seat = step.quorum.seat
        dying = life == 0 and 0 <= args.die_at <= seat.committed_steps and rank == world - 1
        if dying or seat.committed_steps in (args.hold_at, args.refuse_at):  # this step's quorum as it formed
            step.quorum.wait()  # (the step assumes the last one's while it is taken), then its batch
            indices, seat = step.next_batch(position), step.quorum.seat
        if life == 0 and 0 <= args.die_at <= seat.committed_steps and rank == world - 1:
            log.close()
            os._exit(1)  # mid-step: the others' collectives fail, and torchrun restarts the whole group
        if seat.committed_steps == args.hold_at and not (args.out / "held").exists():
            (args.out / "held").touch()  # the others wait in this step's collective while the test cuts the link
            _until((args.out / "cut").exists, "the test to cut the link", 0.02)
        epoch = position.epoch
        refusing = seat.committed_steps == args.refuse_at and not (args.out / "refused.pt").exists()
        if refusing:
            before = whole_snapshot(step, position)
            step.quorum.manager.report_error(RuntimeError("a vote against this step (the test's)"))
        loss = step(x[indices], y[indices])
        if refusing:
            torch.save({"before": before, "after": whole_snapshot(step, position)}, args.out / "refused.pt")
        record = {
            "pid": os.getpid(),
            "life": life,
            "step": seat.committed_steps,
            "participants": seat.participants,
            "index": seat.index,
            "committed": step.committed,
            "moved": step.quorum.moved,  # not committed: it stopped where the quorum it assumed had moved
            "epoch": epoch,
            "indices": indices.tolist(),
            "loss": float(loss),
            "time": time.time(),
            "traces": step.traces,
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step.committed:
            trajectory[seat.committed_steps] = whole_snapshot(step, position)
            if world > 1:  # this rank's slices of the optimizer's state
                trajectory[seat.committed_steps]["shards"] = dict(step.programs["step"].shards)
        if step.committed and seat.committed_steps + 1 >= args.min_steps and seat.participants == args.groups:
            break  # every group of this quorum sees the same count and size, and stops after the same step
        time.sleep(0.02)
    log.close()
    torch.save(whole_snapshot(step, position), _file(args, ".pt"))
    torch.save(trajectory, _file(args, f"-life{life}.trajectory.pt"))
    step.quorum.shutdown()


def diloco_state(step) -> dict:
    """Copies of what a DiLoCo sync reads and writes: the replica's weights, both optimizers, θ_global."""
    return copy.deepcopy(
        {
            "model": step.model.state_dict(),
            "inner": step.optimizer.state_dict(),
            "outer": step.outer_optimizer.state_dict(),
            "global": step.global_parameters(),
        }
    )


def diloco(args: argparse.Namespace, life: int) -> None:
    """DiLoCo across groups: H inner AdamW steps on the group's own samples, then a sync under the quorum (under
    ``streaming_diloco``, one fragment's sync every H/P steps, the fragments in turn). A group
    of several ranks trains its replica with ZeRO-1 inside (``replica_mode="zero1"``: each rank holds a slice of
    the inner optimizer's state, and heals that slice from the same rank of a peer group), each rank on its share
    of the group's batch. ``--die-at K``: the first life of the group's last rank ends before inner step K
    (mid-round); its torchrun restarts the whole group. Each committed sync is saved by every rank with the state
    before and after it and the rank's slices, for the test's reference outer step; the group's rank 0 logs."""
    x, y = dataset()
    if life > 0:  # back only once the others have synced without this group (as data_parallel does)
        _wait_for_steps_without(args, 1)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    rank, world = dist.get_rank(), dist.get_world_size()
    inside = {"replica_mode": "zero1"} if world > 1 else {}
    if args.mode == "streaming_diloco":  # each fragment syncs every H steps, the two H/2 apart
        inside["fragments"] = FRAGMENTS
    step = transpile(
        model, optimizer, mode_config(args.mode, sync_every=SYNC_EVERY, **inside), LOSS, fault_tolerance=_setting(args)
    )
    _first_groups_up(args, life)
    own = torch.arange(int(args.group[1:]), SAMPLES, args.groups)  # this group's samples
    log = (args.out / f"{args.group}.jsonl").open("a") if rank == 0 else None
    syncs: dict[int, dict] = {}
    calls = 0
    while True:
        step.quorum.join()  # a returning group heals here, before the state it syncs from is read
        if life == 0 and 0 <= args.die_at <= step.schedule.step and rank == world - 1:
            os._exit(1)  # the group's other ranks fail in its next collective, and torchrun restarts them all
        variant = step.schedule.variant()
        syncing = variant.startswith("sync")
        if syncing:  # the sync's quorum first: a group that is behind (it joined late) heals here, before its
            step.quorum.begin()  # state is read; the step then runs under this quorum
        start = calls * PER_GROUP * world % len(own)
        indices = own[start : start + PER_GROUP * world][rank * PER_GROUP : (rank + 1) * PER_GROUP]
        before = diloco_state(step) if syncing else None
        step(x[indices], y[indices])
        calls += 1
        seat = step.quorum.last_seat if syncing else None
        record = {"pid": os.getpid(), "life": life, "sync": syncing, "committed": step.committed, "time": time.time()}
        record["traces"] = step.traces
        if seat is not None:
            record |= {"step": seat.committed_steps, "participants": seat.participants}
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if syncing and step.committed:
            after, shards = diloco_state(step), dict(step.programs[variant].shards)
            syncs[seat.committed_steps] = {
                "before": before,
                "after": after,
                "indices": indices,
                "shards": shards,
                "variant": variant,
            }
            if seat.committed_steps + 1 >= args.min_steps and seat.participants == args.groups:
                if _together(args, seat.committed_steps) >= args.together:
                    break
        time.sleep(0.02)
    if log is not None:
        log.close()
    torch.save(syncs, args.out / f"{args.group}-r{rank}-life{life}.syncs.pt")
    step.quorum.shutdown()


if __name__ == "__main__":
    main()
