"""Any other torch.optim optimizer: its own ``step()`` traced into the step graph.

SGD, Adam and AdamW have exact functional twins (``twins.py``). Every other optimizer, torch's
or the user's own subclass of ``torch.optim.Optimizer``, runs its real ``step()`` while the step is
traced: its param groups point at traced copies of the parameters, whose ``.grad`` is the traced
gradient, and its state at traced copies of the state. In-place updates become out-of-place ops
(functionalisation) and the state after the step becomes graph outputs.

What eager computes in Python from tensors (the step count's ``.item()``, then bias corrections and
step sizes) is traced symbolically: the fake tensors carry a shape environment, so ``.item()`` gives a
symbolic float and the Python arithmetic on it is recorded as graph nodes, run in Python doubles at
every step as eager runs it. Each group's ``lr`` enters the same way, as a per-step scalar input the
runtime reads from ``param_groups``, so LR schedulers work without re-tracing. Every other
hyper-parameter is a constant of the trace; changing one is an error that says so.

State that an optimizer creates lazily on its first step is created inside that step's graph and
written back; the second step has state, so it is traced again once, with the state as inputs.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import unittest.mock
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from transpiler.errors import UnsupportedOptimizerError

from .chain import OptimizerChain
from .twins import OptimizerPlan, unlinked

REFUSED = {
    torch.optim.LBFGS: "LBFGS re-evaluates the loss through a closure several times per step, which one step "
    "graph cannot hold",
    torch.optim.SparseAdam: "SparseAdam needs sparse gradients, and the traced step produces dense ones",
}
SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "lr")  # not hyper-parameters


class DataDependentStep(UnsupportedOptimizerError):
    """The optimizer's step branches on a value computed from its state."""


class GenericPlan(OptimizerPlan):
    """Traces ``optimizer.step()`` itself; ``lr`` of every group is a per-step scalar input."""

    kind = "generic"
    scalars_as_tensors = False  # each lr is fed as a float; Python arithmetic on it is traced symbolically
    LEARNT = ("tensor_path", "output_keys")

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], names: list[str]):
        why = next((why for kind, why in REFUSED.items() if isinstance(optimizer, kind)), None)
        if why is not None:
            raise UnsupportedOptimizerError(f"{type(optimizer).__name__} is not supported: {why}.")
        self.output_keys: dict[int, list[str]] = {}
        self.tensor_path = False  # chosen when the default path branches on the step count (RAdam, ASGD)
        super().__init__(optimizer, params, names)

    def can_take_tensor_path(self) -> bool:
        return not self.tensor_path and "capturable" in self.optimizer.defaults

    @contextlib.contextmanager
    def _tensor_path_if_chosen(self) -> Iterator[None]:
        """With ``tensor_path``: every group ``capturable=True`` and torch's "compiling" flag on (which only
        skips the check that capturable state lives on a GPU), so the step count stays a tensor and the
        optimizer takes its branch-free ``torch.where`` form, as under ``torch.compile``."""
        if not self.tensor_path:
            yield
            return
        saved = [group.get("capturable") for group in self.optimizer.param_groups]
        try:
            for group in self.optimizer.param_groups:
                group["capturable"] = True
            with unittest.mock.patch("torch.compiler.is_compiling", return_value=True):
                yield
        finally:
            for group, value in zip(self.optimizer.param_groups, saved):
                group["capturable"] = value

    def _check_group(self, group: dict, gi: int) -> None:
        super()._check_group(group, gi)
        if isinstance(group.get("lr"), torch.Tensor) and group["lr"].numel() != 1:
            raise UnsupportedOptimizerError(f"param group {gi} has a tensor lr of {group['lr'].numel()} elements.")

    def _frozen(self, group: dict) -> tuple:
        return tuple(
            (k, v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in sorted(group.items())
            if k != "params" and k not in SCHEDULER_KEYS
        )

    def _slot_names(self, group: dict) -> list[str]:
        return ["lr"]

    def state_keys(self, position: int) -> list[str]:
        state = self.optimizer.state.get(self.params[position], {})
        _refuse_python_values(self.optimizer, [k for k, v in state.items() if not isinstance(v, torch.Tensor)])
        return list(state)

    def output_state_keys(self, position: int) -> list[str]:
        return self.output_keys.get(position, self.state_keys(position))

    def state_tensors(self, position: int) -> list[torch.Tensor]:
        state = self.optimizer.state.get(self.params[position], {})
        return [unlinked(state[k]) for k in self.state_keys(position)]

    def scalar_values(self, ahead: int = 0) -> list[float]:
        if ahead:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} takes the generic path, which applies the optimizer once per "
                "step; this mode applies it several times per step (allgather). Use SGD, Adam or AdamW here."
            )
        values = []
        for g in self.groups:
            group = self.optimizer.param_groups[g.index]
            if self._frozen(group) != g.frozen_hparams:
                changed = sorted({k for k, _ in set(self._frozen(group)) ^ set(g.frozen_hparams)})
                raise UnsupportedOptimizerError(
                    f"param group {g.index} changed {changed} since the step was traced; only lr is fed each "
                    "step (a scheduler that cycles momentum or betas needs cycle_momentum=False). Call "
                    "transpile() again after changing other hyper-parameters."
                )
            values.append(float(group["lr"]))
        return values

    def step_all(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        states: list[list[torch.Tensor]],
        lrs: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Run the optimizer's own step on traced copies; returns the new parameters and each one's state
        (keys in ``output_state_keys``). ``lrs`` are 0-d float64 tensors, one per group."""
        opt = self.optimizer
        keys = [self.state_keys(i) for i in range(len(params))]  # read before the state is swapped out
        traced = [p.detach().clone() for p in params]
        saved = [(group["params"], group["lr"]) for group in opt.param_groups]
        holders = opt.members if isinstance(opt, OptimizerChain) else [opt]  # who keeps the state
        saved_state = [holder.state for holder in holders]
        try:
            for holder in holders:
                holder.state = defaultdict(dict)
            for g, lr in zip(self.groups, lrs):
                group = opt.param_groups[g.index]
                group["params"] = [traced[i] for i in g.param_positions]
                group["lr"] = lr if self.tensor_path else lr.item()  # capturable forms take a tensor lr
            for i, (t, grad) in enumerate(zip(traced, grads)):
                t.grad = grad
                opt.state[t] = {k: s.clone() for k, s in zip(keys[i], states[i])}
            try:
                with torch.no_grad(), self._tensor_path_if_chosen(), contextlib.ExitStack() as patches:
                    for kind in {type(holder) for holder in holders}:  # a chain's members, or the optimizer
                        patches.enter_context(_symbolic_min_max(kind))
                    opt.step()
            except Exception as exc:
                if "GuardOnDataDependent" in type(exc).__name__ or "data-dependent" in str(exc):
                    raise DataDependentStep(
                        f"{type(opt).__name__}.step() branches in Python on a value of its state (the step count, "
                        "say), which one traced graph cannot hold"
                        + ("" if self.tensor_path else " and it has no capturable (tensor-only) form")
                        + f". Torch said: {str(exc).strip().splitlines()[0][:200]}"
                    ) from exc
                if isinstance(exc, UnsupportedOptimizerError):
                    raise
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                raise UnsupportedOptimizerError(
                    f"{type(opt).__name__}.step() failed while the step was traced ({type(exc).__name__}: {first}). "
                    "The generic path runs the optimizer's own step on traced tensors: it must use tensor ops on "
                    "p, p.grad and tensors in self.state."
                ) from exc
            new_states = []
            for i, t in enumerate(traced):
                self.output_keys[i] = list(opt.state[t])
                new_states.append([opt.state[t][k] for k in self.output_keys[i]])
        finally:
            for group, (group_params, lr) in zip(opt.param_groups, saved):
                group["params"], group["lr"] = group_params, lr
            for holder, state in zip(holders, saved_state):
                holder.state = state
        loose = {k for i, t in enumerate(new_states) for k, v in zip(self.output_keys[i], t) if not torch.is_tensor(v)}
        _refuse_python_values(opt, sorted(loose))
        return traced, new_states


def _refuse_python_values(optimizer: torch.optim.Optimizer, keys: list[str]) -> None:
    if keys:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} keeps optimizer state {keys[:3]} as Python values, which a traced step "
            "cannot update; keep it in tensors (state['step'] = torch.tensor(0.0), as torch.optim does)."
        )


def _sym_aware(builtin: Callable, symbolic: Callable) -> Callable:
    def pick(*args, **kwargs):
        if len(args) == 2 and not kwargs and any(isinstance(a, (torch.SymFloat, torch.SymInt)) for a in args):
            return symbolic(*args)
        return builtin(*args, **kwargs)

    return pick


@contextlib.contextmanager
def _symbolic_min_max(kind: type) -> Iterator[None]:
    """``min``/``max`` of two numbers, one symbolic (Adafactor's ``min(lr, 1 / sqrt(step))``), become graph
    nodes (``torch.sym_min``/``sym_max``, Python's ``min``/``max`` on the floats at run time) instead of a
    branch on an unknown value. Patched in the module where the optimizer's ``step`` is written, while it steps."""
    namespace = inspect.unwrap(kind.step).__globals__  # where step() is written (torch.optim._adafactor)
    saved = {name: namespace[name] for name in ("min", "max") if name in namespace}
    namespace["min"], namespace["max"] = (
        _sym_aware(builtins.min, torch.sym_min),
        _sym_aware(builtins.max, torch.sym_max),
    )
    try:
        yield
    finally:
        for name in ("min", "max"):
            if name in saved:
                namespace[name] = saved[name]
            else:
                del namespace[name]
