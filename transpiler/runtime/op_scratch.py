"""The memory an op holds only while it runs, measured once per call signature: the estimate's last term.

A program's schedule sees every tensor its ops return, not what a kernel allocates for itself while it runs:
oneDNN's convolution backward on the CPU holds about two activations' worth of workspace, batch and layer norm
a little, attention its blocks. For the ops of ``graph/memory.py``'s ``SCRATCH_FAMILIES`` this runs the op once on
real tensors of the traced shapes, strides and dtypes (values are random: no kernel here sizes its workspace by
values), takes the peak of its allocations from the profiler's records (``allocations.py``) and keeps what
exceeds its outputs. Results are kept for the process by signature, so a model of repeated blocks measures
each shape once, and a rebuild nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
import torch.fx as fx

from transpiler.graph.memory import scratch_key

from .allocations import allocated_peak

_MEASURED: dict[str, int] = {}


def measure(graph: fx.Graph) -> dict[str, int]:
    """The scratch bytes of each op of ``graph`` in the scratch families, by :func:`scratch_key`."""
    out = {}
    for node in graph.nodes:
        key = scratch_key(node)
        if key is None:
            continue
        if key not in _MEASURED:
            with _native_stderr_quiet():
                _MEASURED[key] = _scratch_of(node)
        out[key] = _MEASURED[key]
    return out


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """The process's standard error (file descriptor 2) sent nowhere: the profiler's native code writes a line
    as it starts and one as it stops, which a user of ``transpiler dump`` should not see for every op measured."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as nowhere:
            os.dup2(nowhere.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _scratch_of(node: fx.Node) -> int:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: _real(a.meta.get("val")))
    devices = {t.device.type for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    results: list[object] = []
    with torch.no_grad():
        peak = allocated_peak(lambda: results.append(node.target(*args, **kwargs)), devices.pop() if devices else "cpu")
    made = sum(
        t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(results) if isinstance(t, torch.Tensor)
    )
    return max(0, peak - made)


def _real(value: object) -> object:
    """A real tensor shaped, strided and typed as the fake ``value`` (floats random, others zero)."""
    if not isinstance(value, torch.Tensor):
        return value
    real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return real.normal_() if real.is_floating_point() else real.zero_()
