"""A mode's strategy under a torchft quorum (``transpile(fault_tolerance=...)``): what changes in its pipeline.

Four passes change, and nothing else. ``scale-loss-grad`` (and DiLoCo's ``diloco-outer-step``) divides by the
step's input ``participants`` instead of the world size: a quorum's size changes from step to step, and the graph
must not be traced again for it. ``broadcast-params`` goes, since torchft makes every group start from the first
one's state (``init_sync``) and heals a late group from a peer. ``flatten-update`` and ``reinplace-optimizer`` go,
so that the update writes new tensors (the flat update writes into the parameters' flat storage) and a step that
the quorum does not commit leaves the old ones untouched; the update stays multi-tensor (``foreach-update``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transpiler.errors import ConfigurationError
from transpiler.graph.pipeline import Pass

from .options import make
from .strategy import Strategy

QUORUM_MODES = ("allreduce", "fused_allreduce", "diloco")  # the modes built under a quorum so far
# options that change what a step is, which the quorum's one-step vote does not cover yet
_NOT_UNDER_QUORUM = {"accumulate_steps": 1, "freeze_groups": 0, "replica_size": 1}


def under_quorum(strategy: Strategy, mode: str, options: dict[str, Any]) -> Strategy:
    """``strategy`` rewritten to run as one replica group of a torchft quorum; an error for a mode or option
    that is not built for it, saying what is."""
    if mode not in QUORUM_MODES:
        raise ConfigurationError(
            f"fault_tolerance is built for modes {', '.join(QUORUM_MODES)}; mode '{mode}' is not yet. Use one "
            "of those, or drop fault_tolerance (torchrun's elastic restarts still recover every mode)."
        )
    for name, off in _NOT_UNDER_QUORUM.items():
        if options.get(name, off) != off:
            raise ConfigurationError(
                f"option {name} does not run under fault_tolerance yet: a quorum votes on each step, and "
                f"{name} spreads one update over several. Drop it, or drop fault_tolerance."
            )
    variants = {variant: _rewritten(passes) for variant, passes in strategy.variants.items()}
    return dataclasses.replace(strategy, variants=variants)


def _rewritten(passes: list[Pass]) -> list[Pass]:
    kept = [p for p in passes if p.name not in ("broadcast-params", "flatten-update", "reinplace-optimizer")]
    return [_counting(p) for p in kept]


def _counting(p: Pass) -> Pass:
    """A pass that divides by the world size, dividing by the step's participant count instead."""
    if p.name == "scale-loss-grad":
        return make("scale-loss-grad", participants=True)
    if p.name == "diloco-outer-step":
        return dataclasses.replace(p, participants=True)
    return p
