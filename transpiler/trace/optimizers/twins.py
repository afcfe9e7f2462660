"""Functional twins of torch.optim's single-tensor SGD, Adam and AdamW (any other optimizer:
``generic.py``).

The traced step must update parameters bit for bit as eager
``optimizer.step()`` does on CPU (the single-tensor code path), so each update
below issues the same arithmetic as eager, only out of place. Values that eager
computes in Python doubles every step (``-lr``, Adam's step size and bias
correction) are *scalar slots*: 0-d float64 tensor inputs of the graph that the
runtime fills in place from ``optimizer.param_groups`` before each call, so LR
schedulers keep working, and a compiled or captured program serves every step
(a Python float would be baked into either). Where eager passes the double as
``alpha=``/``value=``, which take no tensor, the update uses the form that
carries the same bits in float32 and float64 (measured on CPU, and checked by the
bitwise tests; in bfloat16 and float16 both cast ``s`` to the dtype, and eager's
``add`` kernel computes the last ``numel % vector width`` entries of a tensor in a
scalar loop of its own, where a few differ: docs/bitwise.md):
``add(p, g, alpha=s)`` is ``addcmul(p, g, s)``, and ``addcdiv(p, a, d, value=s)``
is ``addcdiv(p, a * s, d)``; ``mul``/``div`` by a 0-d float64 tensor equal
``mul``/``div`` by the float. On the CPU ``reinplace-optimizer`` folds that
product back into ``addcdiv``'s value (``passes/fold_step_size.py``): eager's
call, and eager's bits in bfloat16 too, where the product rounds on its own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from transpiler.errors import UnsupportedOptimizerError

TWINS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}  # exact classes only


@dataclass(frozen=True)
class ScalarSlot:
    """A per-step scalar input of the graph (named ``g<group>_<what>``)."""

    name: str


@dataclass
class GroupPlan:
    """One param group: its index, trainable parameter positions and slots."""

    index: int
    param_positions: list[int]
    slots: dict[str, ScalarSlot]
    frozen_hparams: tuple


class OptimizerPlan:
    """How one torch.optim optimizer is traced, fed and written back."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], names: list[str]):
        self.kind = TWINS.get(type(optimizer), getattr(self, "kind", ""))
        if not self.kind:
            raise UnsupportedOptimizerError(f"{type(optimizer).__qualname__} has no twin; trace it with make_plan().")
        if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__} has step hooks (register_step_pre_hook / register_step_post_hook), "
                "which the traced step would not run; remove them, or run that code before or after calling "
                "the step."
            )
        self.optimizer = optimizer
        self.names = names
        # the parameters this rank's programs update (a pipeline stage's); None: all. The per-step scalars read the
        # step counts and momentum buffers of these only: the others never step here
        self.held: frozenset[str] | None = None
        position = {id(p): i for i, p in enumerate(params)}
        self.groups: list[GroupPlan] = []
        seen: set[int] = set()
        for gi, group in enumerate(optimizer.param_groups):
            self._check_group(group, gi)
            positions = []
            for p in group["params"]:
                if id(p) not in position:
                    if p.requires_grad:
                        raise UnsupportedOptimizerError(
                            f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                            "of the model (was a submodule replaced after the optimizer was made?). Give the "
                            "optimizer model.parameters(): build a new optimizer and transpile() again."
                        )
                    continue
                if id(p) in seen:
                    raise UnsupportedOptimizerError(f"a parameter appears in more than one param group ({gi}).")
                seen.add(id(p))
                positions.append(position[id(p)])
            slots = {slot_name: ScalarSlot(f"g{gi}_{slot_name}") for slot_name in self._slot_names(group)}
            self.groups.append(GroupPlan(gi, positions, slots, self._frozen(group)))
        missing = [names[i] for i in range(len(params)) if id(params[i]) not in seen]
        if missing:
            raise UnsupportedOptimizerError(
                f"trainable parameters {missing[:5]} are in no param group of the optimizer (a submodule "
                "replaced after the optimizer was made, or a layer unfrozen without its group?). Add them with "
                "optimizer.add_param_group(...), build a new optimizer and transpile() again, or set "
                "requires_grad=False."
            )
        self.group_of = {pos: g for g in self.groups for pos in g.param_positions}
        self.params = params

    LEARNT: tuple[str, ...] = ()  # what tracing sets on the plan, which a reused trace hands a new plan

    def learnt(self) -> dict:
        """What tracing taught this plan (copied)."""
        return {key: copy.deepcopy(getattr(self, key)) for key in self.LEARNT}

    def adopt(self, learnt: dict) -> None:
        """Take what tracing taught another plan of the same optimizer (a reused trace's)."""
        for key, value in learnt.items():
            setattr(self, key, copy.deepcopy(value))

    # ---------------------------------------------------------------- checks
    def _check_group(self, group: dict, gi: int) -> None:
        for flag in ("capturable", "differentiable", "fused"):
            if group.get(flag):
                raise UnsupportedOptimizerError(
                    f"param group {gi} sets {flag}=True; the transpiler traces the optimizer's default path "
                    f"(compile=True fuses the update instead), so create the optimizer with {flag}=False."
                )
        if self.kind == "adam" and torch.is_tensor(group.get("betas", (0,))[0]):
            raise UnsupportedOptimizerError("tensor betas are not supported; pass floats.")

    def _frozen(self, group: dict) -> tuple:
        keys = (
            ("weight_decay", "momentum", "dampening", "nesterov", "maximize")
            if self.kind == "sgd"
            else ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
        )
        return tuple((k, group.get(k)) for k in keys)

    def _slot_names(self, group: dict) -> list[str]:
        if self.kind == "sgd":
            return ["neg_lr", "buf_decay", "grad_weight"] if group["momentum"] != 0 else ["neg_lr"]
        names = ["neg_step_size", "bias_correction2_sqrt"]
        if group.get("decoupled_weight_decay") and group["weight_decay"] != 0:
            names.append("decay_factor")
        return names

    # ----------------------------------------------------------------- state
    def state_keys(self, position: int) -> list[str]:
        """Names of the optimizer-state tensors of one trainable parameter."""
        group = self.optimizer.param_groups[self.group_of[position].index]
        if self.kind == "sgd":
            return ["momentum_buffer"] if group["momentum"] != 0 else []
        keys = ["step", "exp_avg", "exp_avg_sq"]
        return keys + ["max_exp_avg_sq"] if group["amsgrad"] else keys

    def state_tensors(self, position: int) -> list[torch.Tensor]:
        """Current state of one parameter, created exactly as eager would on its first step."""
        p = self.params[position]
        state = self.optimizer.state[p]
        out = []
        for key in self.state_keys(position):
            value = state.get(key)
            if value is None:  # created exactly as eager creates it on the first step
                if key == "step":
                    value = torch.tensor(0.0, dtype=torch.float32)
                else:
                    value = torch.zeros_like(p, memory_format=torch.preserve_format)
                if key != "momentum_buffer":  # eager stores the momentum buffer only after the first step
                    state[key] = value
            out.append(unlinked(value))
        return out

    #: the slots are fed as 0-d float64 tensors that the runtime fills in place (the generic path: floats)
    scalars_as_tensors = True

    def scalar_slots(self) -> list[ScalarSlot]:
        return [slot for g in self.groups for slot in g.slots.values()]

    def scalar_inputs(self, names: list[str]) -> dict[str, float]:
        """Values for the scalar ports ``names``: ``<slot>`` for this step, ``<slot>@j`` for the j-th update
        after it within the same step (the all-gather mode applies the optimizer several times per step)."""
        aheads = sorted({int(name.partition("@")[2] or 0) for name in names})
        out: dict[str, float] = {}
        for ahead in aheads:
            for slot, value in zip(self.scalar_slots(), self.scalar_values(ahead)):
                out[f"{slot.name}@{ahead}" if ahead else slot.name] = value
        return out

    def scalar_values(self, ahead: int = 0) -> list[float]:
        """The per-step slot values, computed in Python doubles as eager does (``ahead`` updates later)."""
        values: list[float] = []
        for g in self.groups:
            group = self.optimizer.param_groups[g.index]
            if self._frozen(group) != g.frozen_hparams:
                raise UnsupportedOptimizerError(
                    f"param group {g.index} changed a hyper-parameter other than lr since it was traced "
                    f"({g.frozen_hparams} -> {self._frozen(group)}); call transpile() again."
                )
            lr = float(group["lr"])
            if self.kind == "sgd":
                values.append(-lr)
                if "buf_decay" in g.slots:
                    first = ahead == 0 and any(
                        self.optimizer.state[self.params[i]].get("momentum_buffer") is None for i in self._held(g)
                    )
                    values += [0.0, 1.0] if first else [float(group["momentum"]), 1.0 - float(group["dampening"])]
                continue
            beta1, beta2 = group["betas"]
            step = self._group_step(g) + 1.0 + ahead
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            values += [-(lr / bias_correction1), bias_correction2**0.5]
            if "decay_factor" in g.slots:
                values.append(1 - lr * group["weight_decay"])
        return values

    def _held(self, g: GroupPlan) -> list[int]:
        return [i for i in g.param_positions if self.held is None or self.names[i] in self.held]

    def _group_step(self, g: GroupPlan) -> float:
        """The step count of a group's parameters, which must agree. Read once per flat buffer where they are lanes
        of flat buffers (a bucket's), else from one stacked read of them all (a per-parameter ``.item()`` cost each
        step an op per parameter, and a device sync each on a GPU); a parameter with no state yet (a flat step
        creates it, as eager does) counts 0."""
        counts = [self.optimizer.state[self.params[i]].get("step") for i in self._held(g)]
        lanes = _lane_values(counts)
        if lanes is not None and len(lanes) == 1:
            return lanes.pop()
        alike = all(t is not None and t.shape == () for t in counts) and len({(t.dtype, t.device) for t in counts}) == 1
        if len(counts) > 1 and alike:
            low, high = torch.stack(counts).aminmax()  # one read for the group, not one per parameter
            if bool(low == high):
                return float(low)
        steps = {0.0 if t is None else float(t) for t in counts}  # no state yet: eager's first step makes it 0
        if len(steps) > 1:
            raise UnsupportedOptimizerError(
                f"param group {g.index} has parameters at different step counts {sorted(steps)}; "
                "the transpiler needs one step count per group."
            )
        return next(iter(steps), 0.0)

    def output_state_keys(self, position: int) -> list[str]:
        """The state keys the traced step outputs for one parameter, in order."""
        return self.state_keys(position)

    def write_back(self, position: int, new_state: dict[str, torch.Tensor]) -> None:
        """Store the state the step produced for one parameter (a skipped step passes only what existed)."""
        self.optimizer.state[self.params[position]].update(new_state)

    # ---------------------------------------------------------------- update
    def update(
        self,
        position: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: list[torch.Tensor],
        scalars: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced update of one parameter, reading its group's slots from ``scalars`` (by slot name); returns
        the new parameter and state."""
        g = self.group_of[position]
        group = self.optimizer.param_groups[g.index]
        slot = {k: scalars[s.name] for k, s in g.slots.items()}
        step_fn: Callable = _sgd_update if self.kind == "sgd" else _adam_update
        return step_fn(param, grad, state, group, slot)


def unlinked(value: torch.Tensor) -> torch.Tensor:
    """A state tensor as a program reads it: detached from autograd if it is linked (a state tensor hardly ever
    is), else itself. Every step feeds every state tensor, so a ``detach()`` each is one dispatch per tensor
    per step for nothing (447 a step for AdamW on a 149-tensor model)."""
    return value.detach() if value.requires_grad else value


def _sgd_update(p, grad, state, group, slot):
    g = torch.neg(grad) if group["maximize"] else grad
    if group["weight_decay"] != 0:
        g = torch.add(g, p, alpha=group["weight_decay"])
    new_state = []
    if group["momentum"] != 0:
        buf = torch.addcmul(torch.mul(state[0], slot["buf_decay"]), g, slot["grad_weight"])
        new_state = [buf]
        g = torch.add(g, buf, alpha=group["momentum"]) if group["nesterov"] else buf
    return torch.addcmul(p, g, slot["neg_lr"]), new_state


def _adam_update(p, grad, state, group, slot):
    beta1, beta2 = group["betas"]
    step, exp_avg, exp_avg_sq = state[:3]
    step = torch.add(step, 1)
    g = torch.neg(grad) if group["maximize"] else grad
    if group["weight_decay"] != 0:
        if group.get("decoupled_weight_decay"):
            p = torch.mul(p, slot["decay_factor"])
        else:
            g = torch.add(g, p, alpha=group["weight_decay"])
    exp_avg = torch.lerp(exp_avg, g, 1 - beta1)
    exp_avg_sq = torch.addcmul(torch.mul(exp_avg_sq, beta2), g, g, value=1 - beta2)
    new_state = [step, exp_avg, exp_avg_sq]
    second = exp_avg_sq
    if group["amsgrad"]:
        second = torch.maximum(state[3], exp_avg_sq)
        new_state.append(second)
    denom = torch.add(torch.div(torch.sqrt(second), slot["bias_correction2_sqrt"]), group["eps"])
    return torch.addcdiv(p, torch.mul(exp_avg, slot["neg_step_size"]), denom), new_state


def _lane_values(counts: list[torch.Tensor | None]) -> set[float] | None:
    """The values of 0-d step counts that are all elements of 1-D buffers (``flatten-update``'s lanes), read with
    one op per buffer; None where any is not."""
    bases: dict[int, torch.Tensor] = {}
    for t in counts:
        if t is None or t._base is None or t.dim():
            return None
        bases.setdefault(id(t._base), t._base)
    if any(b.dim() != 1 or b.stride(0) != 1 for b in bases.values()):
        return None
    read = {key: (b.tolist(), b.storage_offset()) for key, b in bases.items()}
    values = set()
    for t in counts:
        lanes, start = read[id(t._base)]
        values.add(lanes[t.storage_offset() - start])
    return values
