"""Turn a collective that failed inside a running graph into an error that names it.

A gloo or NCCL failure surfaces as a ``RuntimeError`` from deep inside the
generated code ("Timed out waiting 3000ms for recv", "Connection reset by
peer"). The traceback still points at the line of the graph's code that
failed; fx names each line's result after its node, so the node (the wait of
a bucket's all-reduce, an exchange, a broadcast) is found and described: what
it reduces, for which parameters, on which group, and how long the rank waited.

Which peer is at fault the failure itself rarely says (a timed-out receive names no one), so the failing rank
asks: it reports its failure in torch.distributed's store and waits a few seconds for the other ranks'
reports. Ranks that fail the same collective report too; a rank that stalled, died or sits behind a cut link
does not, and the error names it. A rank that cannot reach the store at all is the one cut off, and says so.
The collectives a step runs outside its graphs (DCP's, a checkpointer's barriers) are named the same way
(:func:`failures_named`), so a link cut while a checkpoint is written fails like one cut mid-step.
"""

from __future__ import annotations

import linecache
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
import torch.fx as fx

from transpiler.errors import CommunicationError
from transpiler.graph.collectives import is_collective, is_wait, signature
from transpiler.graph.p2p import is_exchange

from .process_group import Placement

_MARKERS = ("gloo", "Timed out", "timed out", "Connection reset", "Connection closed", "NCCL", "c10d", "peer")
_ASSIGN = re.compile(r"^\s*(\w+)\s*=")


def is_communication_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS))


def failing_node(exc: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The node whose line of ``gm``'s generated code raised ``exc`` (innermost such frame)."""
    filename = gm.forward.__code__.co_filename
    found = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            found = tb.tb_lineno
        tb = tb.tb_next
    if found is None:
        return None
    match = _ASSIGN.match(linecache.getline(filename, found))
    if match is None:
        return None
    return next((n for n in gm.graph.nodes if n.name == match.group(1)), None)


def describe(node: fx.Node | None) -> str:
    if node is None:
        return "a collective"
    target = node.args[0] if is_wait(node) and isinstance(node.args[0], fx.Node) else node
    if is_exchange(target):
        return f"the exchange with rank {target.args[1]} ('{target.name}')"
    if not is_collective(target):
        return f"node '{target.name}'"
    info = target.meta.get("collective", {})
    bucket = f", bucket {info['bucket']}" if "bucket" in info else ""
    names = list(next((v for v in info.values() if isinstance(v, tuple)), ()))
    of = f" of {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}" if names else ""
    return f"'{target.name}' ({signature(target)}{bucket}{of})"


def silent_peers(rank: int, world: int, group: str, wait_s: float) -> list[int] | None:
    """The ranks of ``group`` that did not report a failure in the default store within ``wait_s`` seconds of
    this rank's report (None: the store cannot be reached from here, or there is none). Keys are per group, so
    the steps of another group in the same job never answer for this one's ranks."""
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        key = f"transpiler/failed/{group}/"
        store.set(f"{key}{rank}", "1")
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(world) if r != rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{key}{r}"])]
            time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 (a store that is gone or cut off: say so instead)
        return None


def who_is_silent(rank: int, world: int, group: str, timeout: timedelta) -> str:
    wait_s = min(5.0, max(timeout.total_seconds() / 4, 0.5))
    silent = silent_peers(rank, world, group, wait_s)
    if silent is None:
        return "this rank cannot reach the store either, so it is the one cut off (or the store's host is gone)"
    if not silent:
        return "every rank failed here too: look for the first error in the ranks' output"
    return (
        f"waited for ranks {', '.join(map(str, silent))}, which did not report this failure within {wait_s:g} s: "
        "they stalled, died or cannot be reached"
    )


@contextmanager
def failures_named(what: str | Callable[[BaseException], str], placement: Placement) -> Iterator[None]:
    """Inside the block, a failed collective (not one already named) becomes a CommunicationError that says
    ``what`` failed (or ``what(exc)``), after how long, and which of the placement's ranks went silent."""
    start = time.perf_counter()
    try:
        yield
    except CommunicationError:
        raise
    except Exception as exc:
        if placement.world_size > 1 and is_communication_failure(exc):
            raise communication_error(
                exc, what(exc) if callable(what) else what, placement, time.perf_counter() - start
            ) from exc
        raise


def in_graph(gm: fx.GraphModule, program: str) -> Callable[[BaseException], str]:
    """``what`` failed in a running graph: the collective on the line that raised, and the program."""
    return lambda exc: f"{describe(failing_node(exc, gm))} in program '{program}'"


def communication_error(exc: BaseException, what: str, placement: Placement, elapsed: float) -> CommunicationError:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    rank, timeout = placement.rank, placement.timeout
    silent = who_is_silent(rank, placement.world_size, placement.group_name, timeout)
    return CommunicationError(
        f"rank {rank}: {what} failed after {elapsed:.1f} s (timeout {timeout.total_seconds():g} s); {silent}. "
        "Another rank stalled, died or runs a different program: check the other ranks' output; set the timeout "
        f"with transpile(..., timeout=seconds) or init_process_group(timeout=...). Torch said: {first[:400]}"
    )


def run_named(run: Callable, gm: fx.GraphModule, inputs: list, label: str, placement: Placement) -> tuple:
    """Run a graph (``run``: it, or its compiled or captured form); a failed collective becomes a
    CommunicationError that names it, in program ``label``."""
    with failures_named(in_graph(gm, label), placement):
        return run(*inputs)
