"""The collectives the passes put into graphs: torch's functional c10d ops.

Collectives are recognised by their op (never by node names), and each one a
pass inserts carries ``meta["collective"]``: what it reduces and for which
parameters, so verifiers, the CLI and benchmarks can read it back.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.fx as fx

from .p2p import is_exchange

C10D = torch.ops._c10d_functional
WAIT = C10D.wait_tensor.default
# an ``extra`` output whose name starts so carries a collective's result unwaited to a later program, which waits
# for it (Streaming DiLoCo's exchange overlapping inner steps)
COLLECTIVES = frozenset(
    {
        C10D.all_reduce.default,
        C10D.all_reduce_.default,
        C10D.broadcast.default,
        C10D.all_gather_into_tensor.default,
        C10D.reduce_scatter_tensor.default,
        C10D.all_to_all_single.default,
    }
)


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVES


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


@dataclass(frozen=True)
class CollectiveSignature:
    """What every rank must agree on for one collective call."""

    op: str
    detail: str  # reduce op, or broadcast source
    shape: tuple[int, ...]
    dtype: str
    group: str

    def __str__(self) -> str:
        return f"{self.op}({self.detail}) {self.dtype}{list(self.shape)} group={self.group}"


def signature(node: fx.Node) -> CollectiveSignature:
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"
    op = node.target._schema.name.split("::")[-1]
    detail = str(node.args[1]) if len(node.args) > 2 else ""
    # a tensor-parallel plan's collective names its mesh dimension: each rank's 'tp' group is another group
    return CollectiveSignature(op, detail, shape, dtype, node.meta.get("mesh_dim") or str(node.args[-1]))


def collective_sequence(graph: fx.Graph) -> list[CollectiveSignature]:
    return [signature(n) for n in graph.nodes if is_collective(n)]


@dataclass(frozen=True)
class CommOp:
    """One communication step of a rank, as the cross-rank checks see it (static and at startup).

    A collective has its signature; an exchange (point-to-point send and
    receive with ``peer``) has its send and receive sizes and dtype.
    """

    collective: CollectiveSignature | None = None
    peer: int = -1
    send: int = 0
    recv: int = 0
    dtype: str = ""

    def __str__(self) -> str:
        if self.collective is not None:
            return str(self.collective)
        return f"exchange with {self.peer} (send {self.send}, receive {self.recv} {self.dtype})"


def communication_plan(graph: fx.Graph, outside: Collection[str] = ()) -> list[CommOp]:
    """The collectives and exchanges of a graph, in the order it issues them; ``outside`` names groups whose
    collectives are left out (a group each rank is alone in, as the world sees it: torchft's across groups)."""
    plan = []
    for node in graph.nodes:
        if is_collective(node):
            if (op := CommOp(signature(node))).collective.group not in outside:
                plan.append(op)
        elif is_exchange(node):
            send = node.args[0].meta["val"]
            plan.append(CommOp(None, node.args[1], send.numel(), node.args[2], str(send.dtype).removeprefix("torch.")))
    return plan
