"""``transpiler::exchange``: a point-to-point send and receive with one peer, as a graph op.

torch's functional ``batch_p2p_ops`` returns an empty tensor for the send whose
wait cannot be matched, which leaves un-waited work behind on every call. This
op posts the send and the receive together (``batch_isend_irecv``, so the pair
cannot deadlock) and returns when both are complete: the received tensor is
ready when the op returns, so no wait node follows it. Peers are global ranks
of the default group. A fake implementation gives shapes to tracing and to
static builds without a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx


@torch.library.custom_op("transpiler::exchange", mutates_args=())
def exchange(send: torch.Tensor, peer: int, recv_numel: int) -> torch.Tensor:
    """Send ``send`` to ``peer`` and receive ``recv_numel`` elements of the same dtype from it."""
    recv = torch.empty(recv_numel, dtype=send.dtype, device=send.device)
    ops = [dist.P2POp(dist.isend, send.contiguous(), peer), dist.P2POp(dist.irecv, recv, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


@exchange.register_fake
def _exchange_fake(send: torch.Tensor, peer: int, recv_numel: int) -> torch.Tensor:
    return send.new_empty(recv_numel)


EXCHANGE = torch.ops.transpiler.exchange.default
# it sends as well as receives: a pass's dead-code elimination keeps it when nothing reads what it received (an
# empty piece of a rank whose half of the vector is empty), or the peer would wait for a send that never comes
fx.node.has_side_effect(EXCHANGE)


def is_exchange(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is EXCHANGE
