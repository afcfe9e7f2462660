"""``FaultTolerance``: how a torchrun job runs as one replica group under a torchft quorum (``quorum.py`` runs it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from transpiler.errors import ConfigurationError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse's address
REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's examples' variable for the group's id


@dataclass(frozen=True)
class FaultTolerance:
    """``transpile(..., fault_tolerance=FaultTolerance(...))``: run the step as one replica group under a
    torchft quorum. ``lighthouse`` is the lighthouse's address (``http://host:29510``; default
    ``$TORCHFT_LIGHTHOUSE``), ``replica_id`` this group's name, the same across its restarts (default
    ``$REPLICA_GROUP_ID``), ``min_replicas`` the fewest groups a step commits with. ``timeout`` (seconds) bounds
    every collective across groups, the commit vote and healing: a peer that stops answering costs the others
    this long once. ``quorum_timeout`` bounds the wait for a quorum of ``min_replicas`` groups. ``max_retries``:
    after this many steps in a row that did not commit, the step raises a CommunicationError instead of retrying
    (None: retry for ever). ``async_quorum``: in the data-parallel modes, take each step's quorum on a thread
    while the step runs, and vote while its update computes (default False: both before and after the step, as
    torchft's ``use_async_quorum=False``, which measured faster on a 2-core machine: docs/fault_tolerance.md;
    DiLoCo's syncs always take theirs before the step). ``quorum_every``: in the data-parallel modes, a quorum
    after every this many committed steps, the steps between running under the last one: a lost group still
    fails the step it is lost in, and the next step takes a quorum before it runs; a group that joins or comes
    back waits up to this many steps for the others to ask."""

    lighthouse: str | None = None
    replica_id: str | None = None
    min_replicas: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 120.0
    max_retries: int | None = 10
    async_quorum: bool = False
    quorum_every: int = 1

    def resolved(self) -> FaultTolerance:
        """This setting with the environment's defaults filled in, checked."""
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        replica_id = self.replica_id or os.environ.get(REPLICA_ENV)
        if not lighthouse:
            raise ConfigurationError(
                f"fault_tolerance needs the torchft lighthouse's address: FaultTolerance(lighthouse='http://HOST:"
                f"PORT') or ${LIGHTHOUSE_ENV}. Start one with `torchft_lighthouse --min_replicas 1`."
            )
        if not replica_id:
            raise ConfigurationError(
                f"fault_tolerance needs this replica group's id, the same across its restarts: "
                f"FaultTolerance(replica_id='group0') or ${REPLICA_ENV}."
            )
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ConfigurationError(f"min_replicas must be an int >= 1, got {self.min_replicas!r}.")
        retries = self.max_retries
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
            raise ConfigurationError(f"max_retries must be an int >= 0 or None, got {retries!r}.")
        if not isinstance(self.async_quorum, bool):
            raise ConfigurationError(f"async_quorum must be True or False, got {self.async_quorum!r}.")
        every = self.quorum_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"quorum_every must be an int >= 1, got {every!r}.")
        for name in ("timeout", "quorum_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}.")
        return replace(self, lighthouse=lighthouse, replica_id=replica_id)
