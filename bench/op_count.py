"""Count the aten ops a step dispatches: what a host pays per step, exactly, whatever the machine's load.

A ``TorchDispatchMode`` around the step sees every aten op: forward, backward (the autograd engine carries the
mode to its thread), DDP's bucket copies and the optimizer, eager and traced alike. Ops split into *work*,
which on a GPU is about one kernel launch each, and *views* (``func.is_view``, ``detach``, ``alias``), which
launch nothing but still cost the host a dispatch (``transpiler.graph.op_counts.is_view_op``, which
``transpiler dump --op-counts`` uses too). Dynamo refuses such a mode around a compiled call, so
compiled programs are timed, not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

from transpiler.graph.op_counts import is_view_op


class DispatchCounter(TorchDispatchMode):
    """Counts each aten op dispatched while it is active (``counts``: op -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def work(self) -> int:
        return sum(n for func, n in self.counts.items() if not is_view_op(func))

    @property
    def views(self) -> int:
        return sum(n for func, n in self.counts.items() if is_view_op(func))


def count_ops(run: Callable[[], object]) -> DispatchCounter:
    """The ops one call of ``run`` dispatches."""
    with DispatchCounter() as counter:
        run()
    return counter
