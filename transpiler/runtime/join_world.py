"""Joining the world under torchrun: ``init_distributed()``, which restarts cannot confuse and nothing can stall.

Since torch 2.4 torchrun's agent keeps one TCPStore for the whole job and hands it to the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; pytorch/pytorch#128096), and torch's ``env://`` start writes the group's
keys into it with no prefix for the restart round (pytorch/pytorch#135712). A round after a restart then finds
the dead round's keys: gloo reads a dead rank's address (``connectFullMesh ... Connection refused``), or waits on
a count the dead round already advanced. The restart count the agent passes cannot name the round either: an
agent whose workers did not fail does not count the restart.

So the ranks agree on a name for this round before anything else: each writes a fresh random token under its
rank; rank 0 answers every token it finds with a name of its own (a fresh one too), until every rank has
announced itself under that name; the group is then formed in a store prefixed by it, where no earlier round
ever wrote. A stale token from a dead round gets an answer no one reads. Every wait is bounded by ``timeout``,
and one that runs out names who was missing: rank 0 the ranks that never announced themselves, the others rank 0.
A first collective after the group is formed checks the group itself within the same bound.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from transpiler.errors import CommunicationError, ConfigurationError

KEY = "transpiler/join"
POLL_S = 0.02


def init_distributed(
    backend: str = "gloo", timeout: float | timedelta = 120.0, device_id: torch.device | None = None
) -> None:
    """``torch.distributed.init_process_group(backend)`` for a worker torchrun started (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), in a namespace of its own restart round (module docstring), every wait
    bounded by ``timeout`` seconds; ``device_id`` as torch's (NCCL binds the group to it)."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    env = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [name for name, value in env.items() if value is None]
    if missing:
        raise ConfigurationError(
            f"init_distributed() joins a world torchrun started ({', '.join(missing)} not set): launch the script "
            "with torchrun, e.g. torchrun --standalone --nproc-per-node 2 script.py."
        )
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = _store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), rank, world, seconds)
    name = _agree(store, rank, world, seconds)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"transpiler/{name}/", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=seconds),
        device_id=device_id,
    )
    dist.barrier()  # the group works: a first collective, within the group's timeout


def _store(host: str, port: int, rank: int, world: int, seconds: float) -> dist.Store:
    """The job's store: the agent's where torchrun shares it, else the one rank 0 hosts (as ``env://``)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    try:
        return dist.TCPStore(
            host,
            port,
            world,
            is_master=rank == 0 and not shared,
            timeout=timedelta(seconds=seconds),
            multi_tenant=not shared,
            wait_for_workers=False,  # the handshake below waits, and names who is missing
        )
    except (RuntimeError, TimeoutError) as error:
        host_of = "torchrun's agent" if shared else "rank 0"
        raise CommunicationError(
            f"rank {rank}: the store at {host}:{port} ({host_of}'s) did not answer within {seconds:g} s; is "
            f"MASTER_ADDR reachable from this host, and did {host_of} start? Torch said: {str(error)[:300]}"
        ) from error


def _agree(store: dist.Store, rank: int, world: int, seconds: float) -> str:
    """This round's name, the same on every rank (module docstring)."""
    token = uuid.uuid4().hex
    deadline = time.monotonic() + seconds
    if rank == 0:
        return _answer(store, token, world, deadline, seconds)
    store.set(f"{KEY}/rank{rank}", token)
    name = _wait(store, f"{KEY}/answer/{token}", deadline)
    if name is None:
        raise CommunicationError(
            f"rank {rank} of {world}: rank 0 did not answer within {seconds:g} s (not started, or stopped before "
            "it joined); every rank must start within the timeout."
        )
    store.set(f"{KEY}/{name}/here/{rank}", "1")
    if _wait(store, f"{KEY}/{name}/go", deadline) is None:
        raise CommunicationError(
            f"rank {rank} of {world}: rank 0 answered, but not every rank announced itself within {seconds:g} s "
            "(rank 0's error names them)."
        )
    return name


def _answer(store: dist.Store, name: str, world: int, deadline: float, seconds: float) -> str:
    """Rank 0: answer every rank's token with ``name`` until every rank is here under it, then say go."""
    here = [f"{KEY}/{name}/here/{r}" for r in range(1, world)]
    answered: dict[int, str] = {}
    while True:
        for r in range(1, world):
            key = f"{KEY}/rank{r}"
            if store.check([key]):
                token = store.get(key).decode()
                if answered.get(r) != token:
                    store.set(f"{KEY}/answer/{token}", name)
                    answered[r] = token
        absent = [r for r, key in zip(range(1, world), here) if not store.check([key])]
        if not absent:
            store.set(f"{KEY}/{name}/go", "1")
            return name
        if time.monotonic() > deadline:
            raise CommunicationError(
                f"rank 0 of {world}: rank(s) {absent} did not join within {seconds:g} s (not started, or stopped "
                "before joining); every rank must start within the timeout."
            )
        time.sleep(POLL_S)


def _wait(store: dist.Store, key: str, deadline: float) -> str | None:
    """The value of ``key`` once it is set, or None at ``deadline``."""
    while not store.check([key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    return store.get(key).decode()


def round_store(timeout: timedelta) -> tuple[str, int, dist.TCPStore | None]:
    """A store of this round's own for torchft's ``Manager`` (address, port, and the server on rank 0): torchft
    writes its manager's address into the store it is given with no mark of the round, and in the job's store
    (torchrun's agent's, shared by every restart) a restarted group's ranks could read the dead round's. Rank 0
    hosts it on a free port at ``MASTER_ADDR``; the others learn the port through the group."""
    host = os.environ["MASTER_ADDR"]
    server = None
    if dist.get_rank() == 0:
        server = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
    port = [server.port if server is not None else 0]
    dist.broadcast_object_list(port, src=0)
    return host, int(port[0]), server
