"""What recomputing one forward op costs, and whether it may be recomputed at all: the recompute pass's price list.

The price of an op is an estimate of its time on a roofline: its floating-point work at ``FLOPS`` or the bytes it
reads and writes at ``BYTES_PER_SECOND``, whichever takes longer. Matmuls, convolutions and attention do work that
grows faster than the bytes they touch (torch's own ``torch.utils.flop_counter`` formulas count it; its attention
formula also for the CPU kernels, which its registry lacks), so they are dear; element-wise ops, reductions and
copies move bytes and are cheap per byte freed; views cost nothing. The two rates are nominal (a CPU core's order of
magnitude): only the ratio ranks the ops, and the choice is checked by the schedule's peak, not by these times.

An op is never recomputed when a second run could give other bits or other effects: ops that draw random numbers
(``Tag.nondeterministic_seeded``: dropout, ``rand``; attention is tagged so for its dropout and is recomputed at
``dropout_p=0``), ops whose bits may change run to run (``Tag.nondeterministic_bitwise``: scatter-adds on a GPU),
collectives and their waits, ops that write their inputs, and ops that make no tensor. Their outputs are kept
instead, so a step's values do not depend on the budget.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from transpiler.graph.collectives import is_collective
from transpiler.graph.memory import tensors_of

FLOPS = 50e9  # a core's order of magnitude, float32 with vector units
BYTES_PER_SECOND = 10e9


def repeatable(node: fx.Node) -> bool:
    """Whether running ``node`` again gives the same tensors and nothing else happens."""
    if node.op != "call_function" or is_collective(node):
        return False
    if node.target is operator.getitem:  # taken out of its op's outputs: as repeatable as that op (a copy read
        return isinstance(node.args[0], fx.Node) and repeatable(node.args[0])  # alone would keep them all alive)
    if not isinstance(node.target, torch._ops.OpOverload) or "out" in node.kwargs:
        return False
    if torch.Tag.nondeterministic_bitwise in node.target.tags:
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags and not _draws_nothing(node):
        return False
    schema = node.target._schema
    return not schema.is_mutable and bool(schema.returns) and tensors_of(node.meta.get("val"))


def _draws_nothing(node: fx.Node) -> bool:
    """Whether a seeded op runs without drawing: attention (``_scaled_dot_product_*``) at ``dropout_p=0``, tagged
    seeded for the dropout it can apply."""
    arguments = node.target._schema.arguments
    at = next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None)
    if at is None:
        return False
    p = node.args[at] if at < len(node.args) else node.kwargs.get("dropout_p", arguments[at].default_value)
    return p == 0


def recompute_seconds(node: fx.Node) -> float:
    """The estimated time of running ``node`` once more (see the module docstring)."""
    if node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload) or node.target.is_view:
        return 0.0
    values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    moved = sum(t.numel() * t.element_size() for v in values for t in tensors_of(v))
    formula = flop_registry.get(node.target.overloadpacket)
    work = 0.0
    if formula is None and "scaled_dot_product" in node.target.__name__:  # the CPU kernels have no formula there
        q, k, v = (a.meta["val"].shape for a in node.args[:3])
        work = float(sdpa_flop_count(q, k, v))
    elif formula is not None:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        try:
            work = float(formula(*args, **kwargs, out_val=node.meta.get("val")))
        except (TypeError, ValueError, RuntimeError):  # a formula that wants what this trace lacks: count bytes
            work = 0.0
    return max(work / FLOPS, moved / BYTES_PER_SECOND)
