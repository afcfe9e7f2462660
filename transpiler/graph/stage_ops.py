"""The ops of pipeline stages: where the traced step is cut, and how the stages' programs talk.

``transpiler::stage_input(x, k)`` marks, in the traced forward, the value stage ``k`` starts from (a copy of the
module input at a split point); its autograd formula is ``transpiler::stage_input_grad(g, k)``, which marks in the
traced backward the gradient stage ``k`` hands back to stage ``k - 1``. Both are copies, present only in a step
traced for a pipeline, and gone from every stage's program: ``split-stages`` turns each into a receive in the stage
that reads it and a send in the stage that makes it.

``transpiler::send`` posts an asynchronous send and returns a one-element token; ``transpiler::wait_sends`` waits
for the sends of its tokens (a program's last op, so no send outlives its step). ``transpiler::recv`` receives and
returns when the tensor has arrived. Peers are ranks of the named process group (the pipeline's). Sends never
block, so any order in which each receive's send is posted before, or without waiting on, that receive runs
without a deadlock: every schedule's order does. Each message reads the one before it (``after``: an input it does
not use), so a compiler that orders ops by their data (Inductor) keeps the schedule's order of messages too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.fx as fx


@torch.library.custom_op("transpiler::stage_input", mutates_args=())
def stage_input(x: torch.Tensor, stage: int) -> torch.Tensor:
    """The input of stage ``stage``: a copy of ``x``."""
    return x.clone()


@stage_input.register_fake
def _stage_input_fake(x: torch.Tensor, stage: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("transpiler::stage_input_grad", mutates_args=())
def stage_input_grad(grad: torch.Tensor, stage: int) -> torch.Tensor:
    """The gradient stage ``stage`` hands back for its input: a copy of ``grad``."""
    return grad.clone()


@stage_input_grad.register_fake
def _stage_input_grad_fake(grad: torch.Tensor, stage: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.stage = inputs[1]


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return stage_input_grad(grad, ctx.stage), None


stage_input.register_autograd(_backward, setup_context=_setup)

_pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # token -> the send's work and its tensor, until waited
_tokens = itertools.count()


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


@torch.library.custom_op("transpiler::send", mutates_args=())
def send(tensor: torch.Tensor, group_name: str, peer: int, tag: int, after: Sequence[torch.Tensor]) -> torch.Tensor:
    """Post the send of ``tensor`` to rank ``peer`` of the group once ``after`` (the stage's message before) is
    made; returns its token for ``wait_sends``."""
    # a copy the send owns: the caller's tensor may be written again before the send completes (Inductor reuses
    # a buffer once no op of the graph reads it; the compiled step's second loss was off by 0.5% before)
    payload = tensor.clone(memory_format=torch.contiguous_format)
    token = next(_tokens)
    _pending[token] = (dist.isend(payload, group=_group(group_name), group_dst=peer, tag=tag), payload)
    return torch.tensor([token], dtype=torch.int64)


@send.register_fake
def _send_fake(
    tensor: torch.Tensor, group_name: str, peer: int, tag: int, after: Sequence[torch.Tensor]
) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("transpiler::recv", mutates_args=())
def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group_name: str,
    peer: int,
    tag: int,
    after: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` from rank ``peer`` of the group, once ``after`` is made."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.irecv(out, group=_group(group_name), group_src=peer, tag=tag).wait()
    return out


@recv.register_fake
def _recv_fake(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group_name: str,
    peer: int,
    tag: int,
    after: Sequence[torch.Tensor],
) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.custom_op("transpiler::wait_sends", mutates_args=())
def wait_sends(tokens: Sequence[torch.Tensor], like: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    """Wait until every send of ``tokens`` has completed (once ``after``, the stage's last message, is made);
    returns a zero shaped as ``like`` (what comes after the messages reads it, so nothing moves ahead of them)."""
    for token in tokens:
        work, _ = _pending.pop(int(token.item()))
        work.wait()
    return torch.zeros_like(like)


@wait_sends.register_fake
def _wait_sends_fake(tokens: Sequence[torch.Tensor], like: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(like)


STAGE_INPUT = torch.ops.transpiler.stage_input.default
STAGE_INPUT_GRAD = torch.ops.transpiler.stage_input_grad.default
SEND = torch.ops.transpiler.send.default
RECV = torch.ops.transpiler.recv.default
WAIT_SENDS = torch.ops.transpiler.wait_sends.default
for _op in (SEND, RECV, WAIT_SENDS):  # they talk to other ranks: dead-code elimination must keep them
    fx.node.has_side_effect(_op)


def is_point_to_point(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (SEND, RECV)
