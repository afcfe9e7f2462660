"""How an optimizer is traced, fed and written back: one plan per optimizer, chosen here.

- ``twins.py``: exact functional twins of SGD, Adam and AdamW (the classes themselves), and the
  :class:`OptimizerPlan` every plan is.
- ``generic.py``: any other ``torch.optim.Optimizer``, its own ``step()`` traced.
- ``chain.py``: several optimizers over disjoint parameters, stepped as one.

The rest of the package asks this module, never the three above: ``as_optimizer`` takes what the user
passed, ``make_plan`` picks the plan, ``TWINS`` says which classes have a twin.
"""

from __future__ import annotations

import torch

from .chain import OptimizerChain, as_optimizer
from .generic import DataDependentStep, GenericPlan
from .twins import TWINS, OptimizerPlan

__all__ = ["TWINS", "DataDependentStep", "GenericPlan", "OptimizerChain", "OptimizerPlan", "as_optimizer", "make_plan"]


def make_plan(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], names: list[str]) -> OptimizerPlan:
    """The exact twin for SGD, Adam and AdamW (the classes themselves), the generic path for any other."""
    if type(optimizer) in TWINS:
        return OptimizerPlan(optimizer, params, names)
    return GenericPlan(optimizer, params, names)
