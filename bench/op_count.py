"""Count the aten ops a step dispatches: what a host pays per step, exactly, whatever the machine's load.

A ``TorchDispatchMode`` around the step sees every aten op: forward, backward (the autograd engine carries the
mode to its thread), DDP's bucket copies and the optimizer, eager and traced alike. Ops split into *work*,
which on a GPU is about one kernel launch each, and *views* (``func.is_view``, ``detach``, ``alias``), which
launch nothing but still cost the host a dispatch (``transpiler.graph.op_counts.is_view_op``, which
``transpiler dump --op-counts`` uses too). A custom op written in Python (``torch.library.custom_op``: the sparse
exchange's ``transpiler::sparse_select`` and ``sparse_decode_mean``, the pipeline's stage ops) is counted as the
aten ops its body dispatches, not as one op: a mode does not otherwise see inside it. Dynamo refuses such a mode
around a compiled call, so compiled programs are timed, not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

from transpiler.graph.op_counts import is_view_op


class DispatchCounter(TorchDispatchMode):
    """Counts each aten op dispatched while it is active (``counts``: op -> calls), and the bytes handed to
    collectives (``sent``: :func:`collective_input_bytes`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = _maybe_get_opdef(func)
        if body is not None:  # a Python custom op: its body's ops, counted (the mode is off inside this call)
            with self:
                return body._init_fn(*args, **(kwargs or {}))
        self.counts[func] += 1
        self.sent += collective_input_bytes(func, args)
        return func(*args, **(kwargs or {}))

    @property
    def work(self) -> int:
        return sum(n for func, n in self.counts.items() if not is_view_op(func))

    @property
    def views(self) -> int:
        return sum(n for func, n in self.counts.items() if is_view_op(func))


# eager (c10d) collectives whose first argument is their output: the input is the second
_OUTPUT_FIRST = {
    "allgather_",
    "_allgather_base_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_",
    "alltoall_base_",
}
_NOT_SENT = {"wait_tensor", "barrier", "monitored_barrier_", "recv_", "recv_any_source_"}


def collective_input_bytes(func, args: tuple) -> int:
    """Bytes of a collective's input tensor(s) (0 for any other op): what the rank hands to it, not what its
    algorithm moves (a ring all-reduce sends about twice that); functional (``_c10d_functional``) or eager
    (``c10d``; a broadcast counts its tensor on every rank)."""
    if getattr(func, "namespace", None) not in ("c10d", "_c10d_functional"):
        return 0
    name = func._schema.name.partition("::")[2]
    if name in _NOT_SENT:
        return 0
    given = args[1] if func.namespace == "c10d" and name in _OUTPUT_FIRST else args[0]
    return sum(t.numel() * t.element_size() for t in _tensors(given))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def count_ops(run: Callable[[], object]) -> DispatchCounter:
    """The ops one call of ``run`` dispatches."""
    with DispatchCounter() as counter:
        run()
    return counter
