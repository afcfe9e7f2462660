"""Replica groups under a torchft quorum: a lost group costs the others one uncommitted step, not a restart.

Each replica group is its own torchrun job; torchft's lighthouse gathers the groups that are alive into a
quorum before every step, and a torchft ``Manager`` reconfigures the process group across them in place
(``ProcessGroupGloo``/``ProcessGroupNCCL``, registered here under a name so that the graph's functional
collectives run on it). What this module adds to a step, around the same rewritten program:

- **the quorum, beside the step** (:meth:`Quorum.begin`): after a committed step the next step's quorum is taken
  on a thread of its own while this process writes the step back, loads the next batch and runs the forward and
  backward (``FaultTolerance.async_quorum``, the data-parallel modes). The step is computed for the quorum it
  assumes, the last one's (its participant count and this group's place in it, which pick its samples), and
  the program's ``transpiler::await_quorum`` node (``overlap-quorum``) waits for the real one before the first
  collective across groups. Where they differ (a group left or joined) or this group must heal, the step stops
  there, before anything has left for another group and without a vote, and runs again under the quorum it
  found: nothing is lost but the forward and backward. A group that starts, or whose last step did not commit,
  takes its quorum before the step, and with it, when it is behind, the whole step state from a live peer over
  torchft's checkpoint transport (``heal``), applied before the step;
- **the participant count as an input**: the program's ``participants`` port (``scale-loss-grad
  {participants=true}``) gets this quorum's size, so the mean is over the groups that take part and a quorum
  change never retraces;
- **the vote** (:meth:`Quorum.run`): torchft's commit vote, cast by the program's ``transpiler::cast_vote`` node
  once its last collective is waited for, on the quorum's thread. A step that does not commit (a peer died
  mid-step, the quorum fell below ``min_replicas``) writes nothing back: parameters, optimizer state, schedule and
  data position stay as they were, bit for bit, and the next call retries under the new quorum. Where the
  update writes in place (``allreduce`` and ``fused_allreduce``, uncompiled), the program's
  ``transpiler::await_vote`` node waits for the count before the first write and stops the program there when
  it says no (:class:`VotedDown`); elsewhere the update is functional and computes while the vote is counted.

Under DiLoCo only the syncs read the participant count, and only they take a quorum and vote (:meth:`seat_for`);
inner steps talk to no other group. A group joins at its first step, whatever it is (:meth:`join`).

No lighthouse, quorum or transport is written here: all of it is torchft's (0.2).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from transpiler.errors import CommunicationError, ConfigurationError, NoQuorumError
from transpiler.graph import quorum_ops
from transpiler.graph.ports import PortKind

from .failures import is_communication_failure
from .fault_tolerance import FaultTolerance
from .join_world import round_store
from .process_group import Placement

log = logging.getLogger("transpiler")


@dataclass(frozen=True)
class Seat:
    """This group's place in the current quorum: its index among the participants, how many there are, and
    how many steps the quorum has committed before this one."""

    index: int
    participants: int
    committed_steps: int


class QuorumMoved(Exception):
    """Raised at a step's ``await_quorum`` node: the quorum taken beside the step is not the one the step was
    computed for (a group left or joined, or this group must heal). Nothing has left for another group yet."""


class VotedDown(Exception):
    """Raised at a step's ``await_vote`` node: the quorum does not commit the step. Nothing is written yet."""


class Quorum:
    """This replica group's torchft ``Manager`` and the process group across groups it reconfigures, with the
    step's participation: :meth:`join` and :meth:`begin` before a step, :meth:`run` for it and the vote, and
    :meth:`take_next` after it. The quorum and the vote run on a thread of their own, one after the other."""

    def __init__(self, setting: FaultTolerance, placement: Placement, every_step: bool = True) -> None:
        setting = setting.resolved()
        try:
            from torchft.manager import Manager
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ImportError as exc:
            raise ConfigurationError(
                "fault_tolerance runs on torchft, which is not installed: pip install 'fx-transpiler[fault-tolerance]'"
                " (torchft 0.2)."
            ) from exc
        if not placement.live or not dist.is_initialized():
            raise ConfigurationError(
                "fault_tolerance needs the replica group's own torch.distributed world: launch the group with "
                "torchrun and call torch.distributed.init_process_group() before transpile()."
            )
        timeout = timedelta(seconds=setting.timeout)
        store_addr, store_port, self._store = round_store(timeout)
        nccl = dist.get_backend() == "nccl"
        self.group = ProcessGroupNCCL(timeout=timeout) if nccl else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=setting.min_replicas,
            # torchft's synchronous semantics, on a thread of our own: a group that is behind heals inside the
            # quorum and takes part in the step (its participant count includes it); the step's program waits
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=setting.quorum_timeout),
            connect_timeout=timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=setting.lighthouse,
            replica_id=setting.replica_id,
            init_sync=True,  # every group starts from the first one's state
            max_retries=setting.max_retries,
        )
        self.setting = setting
        self.group_name = _register(self.group, f"transpiler-quorum-{setting.replica_id}")
        self.every_step = every_step  # every program talks across groups (data parallel); else only some (DiLoCo)
        self.overlapped = setting.async_quorum and every_step  # the quorum taken beside the step (overlap-quorum)
        self.seat: Seat | None = None  # the quorum of the step under way (assumed until its program settles it)
        self.last_seat: Seat | None = None  # the quorum of the last step that took one
        self.joined = False  # this group took part in a quorum (and healed) since it started
        self.has_committed = False  # a step of this process committed under a quorum
        self.moved = False  # the last step stopped at its first collective across groups: the quorum moved
        self.state_lock = threading.Lock()  # held while the step's state is written, and while a peer copies it
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="transpiler-quorum")
        self._taking: Future | None = None  # the quorum under way on the thread
        self._since = 0  # committed steps since the last quorum (quorum_every)
        self._voting: Future | None = None  # the vote under way on the thread
        self._meet = False  # the step under a quorum talks to no other group: the groups meet before it (join)
        self._token = torch.zeros(1, device="cuda" if nccl else "cpu")  # what they all-reduce when they meet
        self._received: dict | None = None  # the state a heal brought, applied on the step's thread
        self._load: Callable[[dict], None] | None = None
        quorum_ops.serve(self.group_name, quorum_ops.QuorumHooks(self._settle, self._cast_vote, self._await_vote))

    def placement(self, placement: Placement, two_level: bool) -> Placement:
        """Where the programs' collectives go: on the group's own world where the strategy reduces in two levels
        (``two_level``: a layout with axis ``across``, which the quorum's group serves, :meth:`across`); else,
        for a group of one rank, across the groups, on the quorum's process group."""
        if two_level:
            return placement
        return replace(placement, group_name=self.group_name, timeout=timedelta(seconds=self.setting.timeout))

    def across(self, axes: tuple[dict[str, tuple[int, ...]], ...]) -> dict[tuple[int, ...], str]:
        return across_groups(axes, self.group_name)

    def serve(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a healing peer takes from this group (copied on the quorum's thread while no step writes the
        state), and how this group takes it from a peer (on the step's thread, before the step)."""
        self._load = load

        def locked_save() -> dict:
            with self.state_lock:
                return save()

        self.manager.register_state_dict_fn("transpiler", self._receive, locked_save)

    def begin(self) -> Seat:
        """This step's quorum (once per step). Taken before the step when none is under way: waited for, the
        process group reconfigured when it changed, and this group healed from a live peer when it is behind
        (it started late, restarted, or its last step did not commit). Under way (:meth:`take_next`): the last
        step's quorum, assumed, which the program's ``await_quorum`` checks."""
        if self.seat is None:
            if self._taking is None and not (self._since and self.last_seat is not None):
                self._taking = self._thread.submit(self._take)
                self.seat = self._wait()
                self._heal()
            else:
                last = self.last_seat
                self.seat = Seat(last.index, last.participants, last.committed_steps + 1)
        return self.seat

    def wait(self) -> Seat:
        """This step's quorum as it formed, waited for (healing this group when it is behind). Where the step had
        assumed another, the step runs under this one; take the step's batch after this call."""
        seat = self.begin()
        if self._taking is not None:
            self.seat = seat = self._wait()
            self._heal()
        return seat

    def take_next(self) -> None:
        """After a committed step is written back (data parallel): counts it, and after every ``quorum_every``
        steps starts the next step's quorum on the quorum's thread (``async_quorum``; else the next step takes it
        before it runs). The steps between run under the last quorum."""
        if self.every_step and self.joined and self._taking is None:
            self._since += 1
            if self._since >= self.setting.quorum_every:
                self._since = 0
                if self.overlapped:
                    self._taking = self._thread.submit(self._take)

    def join(self) -> None:
        """Before this group's first step, whatever it is: the quorum, so that a group that starts late or comes
        back heals from a peer (its step state, schedule included) before it trains. Under DiLoCo this waits
        for the others' next sync (``quorum_timeout`` must cover a round)."""
        if not self.joined:
            self.begin()

    def seat_for(self, program: Any) -> Seat | None:
        """The quorum a step of ``program`` runs under: one that reads the participant count (every step of the
        data-parallel modes, DiLoCo's syncs) or that follows a join; None for a step that talks to no other group
        (DiLoCo's inner steps), which commits without a vote."""
        talks = any(port.kind == PortKind.QUORUM for port in program.inputs)
        if self.seat is None and talks:
            self.begin()
        self._meet = self.seat is not None and not talks
        return self.seat

    def inputs(self) -> dict[str, torch.Tensor]:
        """The program's ``quorum`` ports: ``participants``, the groups that take part in this step (a 0-d CPU
        tensor, as the graph declares it, wherever the parameters are)."""
        return {"participants": torch.tensor(float(self.begin().participants))}

    def run(self, program: Callable[[], Any]) -> tuple[Any, bool]:
        """Run one step's program and vote: (its outputs, or None when it failed; whether the quorum commits).
        A collective that fails because a peer left is reported to torchft, and the step does not commit. A step
        whose quorum moved under it stops before its first collective across groups and is not voted on: the
        next call runs it under the quorum it found."""
        outputs, error = None, None
        self.moved = False
        quorum_failed = self.manager.errored() is not None  # its process group or this group's heal did not set up
        try:
            if self._meet and not quorum_failed:  # a group whose heal failed may be at another step than its peers
                self._meet_peers()
            outputs = program()
        except QuorumMoved as moved:
            self.moved = True
            self._heal()
            log.warning("replica group %r: %s; the step runs again under it", self.setting.replica_id, moved)
            return None, False
        except VotedDown:  # the update in place stopped before its first write: the vote below says no again
            pass
        except NoQuorumError:
            self.seat = None
            raise
        except Exception as exc:  # a peer left mid-step: torchft reconfigures at the next quorum
            error = exc
            if self._voting is None:
                if self._taking is not None:  # it failed before its first collective across groups
                    self.seat = self._wait()
                self.manager.report_error(exc)
        try:
            voting, self._voting = self._voting, None
            committed = voting.result() if voting is not None else self.manager.should_commit()
        except RuntimeError as exc:  # torchft's max_retries: this many steps in a row did not commit
            if "max_retries" not in str(exc):
                raise
            last = f"; the last step failed with {error!r}" if error is not None else "; the last one was voted against"
            raise CommunicationError(
                f"replica group {self.setting.replica_id!r}: {self.setting.max_retries + 1} steps in a row did not "
                f"commit ({exc}){last}. Check the other groups' logs and the lighthouse, or raise "
                "FaultTolerance.max_retries."
            ) from error or exc
        finally:  # the next step takes a quorum of its own, whatever this one did
            self.seat, self.last_seat = None, self.seat
            self._heal()  # a failed step's quorum may have found this group behind
        if error is not None and not (quorum_failed or _is_peer_failure(error)):
            raise error
        if error is not None or not committed:
            why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}" if error else "the vote said no"
            log.warning("replica group %r: step not committed (%s); it is retried", self.setting.replica_id, why)
        committed = committed and error is None
        self.has_committed |= committed
        if not committed:  # the next step takes its quorum before it runs
            self._since = 0
        return outputs, committed

    def shutdown(self) -> None:
        quorum_ops.serve(self.group_name, None)
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------------ on the quorum's thread, and waiting for it
    def _take(self) -> tuple[int | None, int, int]:
        """The quorum (torchft's, synchronous on this thread): this group's index, the participants, the step."""
        self.manager.start_quorum()
        return self.manager.participating_rank(), self.manager.num_participants(), self.manager.current_step()

    def _meet_peers(self) -> None:
        """One all-reduce of a token across the quorum's groups, before a step that talks to no other group (a
        DiLoCo inner step after the join). A group stops serving its state to healing peers once it votes, and
        torchft counts on the step's own collectives to hold that vote back until every peer that heals from it
        has its copy: a group that votes first leaves a slower peer's fetch waiting out the timeout (its heal
        fails, and the peer's first step does not commit). Every group of the quorum runs the same step here: they
        all started together, or a returning group healed to its peers' schedule, which is at a sync. A group
        whose quorum or heal failed does not meet (:meth:`run`): it may be at another step than its peers, and a
        token all-reduced against their sync's bucket would abort gloo; a peer waiting for it at the meeting fails
        after ``timeout`` instead. A failure is reported to torchft, so the step does not commit."""
        try:
            self.group.allreduce([self._token], dist.ReduceOp.SUM).wait()
        except Exception as exc:
            self.manager.report_error(exc)

    def _receive(self, state: dict) -> None:
        """A heal's state, as torchft hands it over inside the quorum: kept for the step's thread to apply."""
        self._received = state

    def _heal(self) -> None:
        received, self._received = self._received, None
        if received is not None:
            with self.state_lock:
                self._load(received)

    def _wait(self) -> Seat:
        """The quorum under way, waited for: this group's seat in it."""
        taking, self._taking = self._taking, None
        try:
            index, participants, step = taking.result()
        except Exception as exc:  # torchft's own error says only "Timeout expired"
            setting = self.setting
            late = (
                ""
                if self.has_committed
                else " This group has not committed a step since it started: if the other groups have finished "
                "the run, it came back too late to heal from them."
            )
            raise NoQuorumError(
                f"replica group {setting.replica_id!r}: no quorum within quorum_timeout={setting.quorum_timeout} s "
                f"({type(exc).__name__}: {exc}). Check that the lighthouse at {setting.lighthouse} is up and that "
                f"at least min_replicas={setting.min_replicas} groups are running.{late}"
            ) from exc
        if index is None:
            raise ConfigurationError("this replica group is not taking part in the quorum (a spare).")
        self.joined = True
        return Seat(index, participants, step)

    def _settle(self) -> None:
        """The program's ``await_quorum``: the quorum taken beside the step, waited for; QuorumMoved when it is not
        the one the step assumed, or when this group must heal (its state is applied once the program stops)."""
        if self._taking is None:
            return
        assumed, self.seat = self.seat, self._wait()
        if self.seat != assumed or self._received is not None:
            healing = ", and this group must heal from a peer" if self._received is not None else ""
            raise QuorumMoved(f"the quorum is {self.seat}, not the {assumed} this step assumed{healing}")

    def _cast_vote(self) -> None:
        """The program's ``cast_vote``: every collective is waited for, so the vote goes out while the update
        computes."""
        self._voting = self._thread.submit(self.manager.should_commit)

    def _await_vote(self) -> None:
        """The program's ``await_vote``, before its update writes in place: the vote counted; VotedDown when the
        step does not commit, so that nothing is written."""
        if not self._voting.result():
            raise VotedDown("the vote said no")


def across_groups(axes: tuple[dict[str, tuple[int, ...]], ...], group_name: str) -> dict[tuple[int, ...], str]:
    """For a strategy that reduces in two levels (one axis per rank of the world): each rank's ``across`` ranks,
    named as the quorum's process group, which joins each rank to those of its place in the other groups. No such
    group is created in the group's own world."""
    return {rank_axes["across"]: group_name for rank_axes in axes if "across" in rank_axes}


@dataclass(frozen=True)
class InspectedQuorum:
    """Where a quorum's program is built to be looked at (``transpile(world_size=..., fault_tolerance=...)``
    without a world, ``transpiler dump --fault-tolerance``): torchft's process group is the label ``quorum`` in the
    graphs, no lighthouse or torchft is needed, and the step cannot run."""

    group_name: str = "quorum"

    def placement(self, placement: Placement, two_level: bool) -> Placement:
        placement = replace(placement, live=False)
        return placement if two_level else replace(placement, group_name=self.group_name)

    def across(self, axes: tuple[dict[str, tuple[int, ...]], ...]) -> dict[tuple[int, ...], str]:
        return across_groups(axes, self.group_name)


def _register(group: Any, name: str) -> str:
    """Register torchft's process group under ``name`` (a subgroup of the default one, so that functional
    collectives find it) and return its group name. Torch connects a new subgroup at once on the device the
    default group is bound to (``init_process_group(device_id=...)``), but torchft's group has no backend until
    its first quorum configures it: the binding is lifted while it registers."""
    default = dist.distributed_c10d._get_default_group()
    bound, default.bound_device_id = default.bound_device_id, None
    try:
        return group.register(name).group_name
    finally:
        default.bound_device_id = bound


def _is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer left (the step is retried), not a bug: a
    ``CommunicationError`` (the step names the failed collective) or torch's own failure of a collective. In the
    worlds of tests/test_quorum.py every failure a lost or cut-off peer caused was one of these (gloo's "Connection
    reset by peer", "Timed out waiting ... for recv"); a ``torch.distributed.DistError`` covers NCCL's."""
    return isinstance(exc, CommunicationError) or is_communication_failure(exc)
