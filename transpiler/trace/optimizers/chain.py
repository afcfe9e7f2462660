"""Several optimizers for one model, stepped as one (Muon on the matrices, AdamW on the rest).

``transpile(model, [muon, adamw], ...)`` wraps the list in :class:`OptimizerChain`, an ordinary
``torch.optim.Optimizer``:

- its param groups *are* the members' groups (the same dicts, read afresh each time), so each member's LR
  scheduler keeps working;
- its ``state`` routes every parameter to the member that owns it, so each member keeps its own state and
  its own ``state_dict()`` works as before;
- its ``step()`` steps each member in order.

The generic path traces it like any other optimizer. Its ``state_dict()`` holds every member's groups and
state (numbered across members, member by member), and ``load_state_dict`` splits one back.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch

from transpiler.errors import ConfigurationError, UnsupportedOptimizerError


class RoutedState(MutableMapping):
    """``optimizer.state`` of a chain: each parameter's entry lives in the state of the member holding it."""

    def __init__(self, members: list[torch.optim.Optimizer]):
        self.members = members

    def _owner(self, param: Any) -> torch.optim.Optimizer:
        for member in self.members:
            if any(p is param for group in member.param_groups for p in group["params"]):
                return member
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        for member in self.members:  # dict lookups first: read every step (runtime cache key)
            if param in member.state:
                return member.state[param]
        return self._owner(param).state[param]  # a new entry, in the owner's defaultdict

    def __contains__(self, param: object) -> bool:
        return any(param in member.state for member in self.members)

    def get(self, param: Any, default: Any = None) -> Any:
        return self[param] if param in self else default

    def __setitem__(self, param: Any, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator:
        return (p for member in self.members for p in member.state)

    def __len__(self) -> int:
        return sum(len(member.state) for member in self.members)


class OptimizerChain(torch.optim.Optimizer):
    """The members' param groups and state as one optimizer; ``step()`` steps each member in order."""

    def __init__(self, members: Sequence[torch.optim.Optimizer]):  # no super().__init__: the groups exist
        self.members = list(members)
        owned = [id(p) for member in self.members for group in member.param_groups for p in group["params"]]
        if len(owned) != len(set(owned)):
            raise ConfigurationError(
                "a parameter is in two of the optimizers given to transpile(); give each parameter to one "
                "optimizer (Muon for the matrices, AdamW for the rest, say)."
            )
        hooked = [type(m).__name__ for m in self.members if m._optimizer_step_pre_hooks or m._optimizer_step_post_hooks]
        if hooked:
            raise UnsupportedOptimizerError(
                f"{hooked[0]} has step hooks (register_step_pre_hook / register_step_post_hook), which the traced "
                "step would not run; remove them, or run that code before or after calling the step."
            )
        self.defaults: dict = {}
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", {})

    @property
    def param_groups(self) -> list[dict]:
        """The members' groups as they are now (a member's ``load_state_dict`` replaces its group dicts)."""
        return [group for member in self.members for group in member.param_groups]

    @property
    def state(self) -> RoutedState:
        return RoutedState(self.members)

    @torch.no_grad()
    def step(self, closure=None):
        for member in self.members:
            member.step()
            member._opt_called = True  # each member's LR scheduler checks that its optimizer stepped

    def load_state_dict(self, state_dict: dict) -> None:
        """Split a chain's ``state_dict()`` into each member's, numbered from 0 again."""
        groups, first_group, first_param = state_dict["param_groups"], 0, 0
        for member in self.members:
            mine = groups[first_group : first_group + len(member.param_groups)]
            count = sum(len(g["params"]) for g in mine)
            member.load_state_dict(
                {
                    "state": {
                        i - first_param: v
                        for i, v in state_dict["state"].items()
                        if first_param <= i < first_param + count
                    },
                    "param_groups": [{**g, "params": [i - first_param for i in g["params"]]} for g in mine],
                }
            )
            first_group, first_param = first_group + len(mine), first_param + count


def as_optimizer(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The optimizer itself, or a list or tuple of them chained into one."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if (
        isinstance(optimizer, (list, tuple))
        and optimizer
        and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    ):
        return optimizer[0] if len(optimizer) == 1 else OptimizerChain(optimizer)
    raise ConfigurationError(
        f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(optimizer).__name__}."
    )
