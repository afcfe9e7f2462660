"""The flat buffers a program declares (``program.flat_buffers``, ``flatten-update``), held between steps.

Each buffer is allocated once; every parameter (``.data``) and every optimizer-state entry it covers is bound
to its view, so the user's tensors stay the user's (``model.parameters()``, ``optimizer.state``,
``state_dict()``, DCP) while the program reads and writes a few flat tensors. Before each step
:meth:`FlatStorage.bind` checks that every tensor is still the view it was bound to. What breaks that, and
what happens:

- ``p.data = t`` or ``optimizer.state[p][key] = t`` (``optimizer.load_state_dict()``, a user's reset): the
  value is copied into the view and the view bound again, as the first bind does. Nothing is lost.
- a state entry removed (``optimizer.state[p].pop(key)``, ``optimizer.state.clear()``): the view is zeroed
  and bound again when the next step writes it, as eager creates state on its first step.
- a parameter whose shape, dtype or device changed (``model.to(torch.float64)``, ``p.data = other_shape``):
  a :class:`ConfigurationError`; the program was traced for the old one, so ``transpile()`` again.
- a program with other buffers (a retrace that bucketed differently): new buffers, filled from the current
  tensors, and everything bound to them.

In-place edits (``p.mul_(0.5)``, ``nn.init.*_``) write into the views and need nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError, UnsupportedOptimizerError
from transpiler.graph.program import FlatBuffer


@dataclass(eq=False)
class _Binding:
    """One tensor of the user's bound to a view of a flat buffer."""

    name: str
    param: torch.nn.Parameter
    key: str  # "" for the parameter itself
    view: torch.Tensor
    pointer: int
    span: tuple[int, int]  # the parameter's elements the view holds (a sharded optimizer's slice)


class FlatStorage:
    """The flat buffers of the program that runs, and the views the user's tensors are bound to."""

    def __init__(self) -> None:
        self.layouts: tuple[FlatBuffer, ...] = ()
        self.buffers: dict[str, torch.Tensor] = {}
        self._kept: dict[tuple[FlatBuffer, ...], dict[str, torch.Tensor]] = {}  # buffers of each layout used
        self._params: list[_Binding] = []
        self._states: list[_Binding] = []
        self._pending: list[_Binding] = []  # state views the next step writes first (not in optimizer.state yet)
        self._lanes: list[torch.Tensor] = []

    def bind(self, layouts: Iterable[FlatBuffer], params: dict[str, torch.nn.Parameter], optimizer) -> None:
        """Before a step: the buffers ``layouts`` declare exist, and every tensor they cover is bound to its view
        (copied in where the user replaced it, or where another program's layout held it)."""
        layouts = tuple(layouts)
        if layouts != self.layouts:
            self._allocate(layouts, params, optimizer)
            return
        for b in self._params:
            if b.param.data_ptr() != b.pointer:
                self._take_param(b)
        state = optimizer.state
        for b in self._states:
            held = state[b.param].get(b.key)
            if held is b.view:
                continue
            if held is None:
                if b not in self._pending:
                    b.view.zero_()
                    self._pending.append(b)
                continue
            if b in self._pending:
                self._pending.remove(b)
            self._take_state(b, held, optimizer)
        self._check_lanes()

    def written(self, optimizer, skipped: bool) -> None:
        """After a step that updated (``skipped`` False): the state entries it created are bound to their views."""
        if skipped or not self._pending:
            return
        for b in self._pending:
            optimizer.state[b.param][b.key] = b.view
        self._pending.clear()

    # ------------------------------------------------------------------ internals
    def _allocate(self, layouts: tuple[FlatBuffer, ...], params: dict[str, torch.nn.Parameter], optimizer) -> None:
        """Bind everything to the buffers of ``layouts`` (made once per layout, kept for a program that comes back:
        a freeze schedule's variants, a retrace), copying the current values in."""
        if self.layouts:
            self._kept[self.layouts] = self.buffers
        buffers = self._kept.get(layouts) or {
            layout.port: torch.zeros(layout.length, dtype=getattr(torch, layout.dtype), device=layout.device)
            for layout in layouts
        }
        bound, states, pending = [], [], []
        for layout in layouts:
            buffer = buffers[layout.port]
            for name, start, shape, span in zip(layout.names, layout.starts, layout.shapes, layout.spans):
                numel = int(torch.Size(shape).numel())
                view = buffer[start : start + numel].view(shape)
                binding = _Binding(name, params[name], layout.key, view, view.data_ptr(), span)
                if layout.kind == "param":
                    self._take_param(binding)
                    bound.append(binding)
                    continue
                held = optimizer.state[params[name]].get(layout.key)
                if held is None:
                    pending.append(binding)
                else:
                    self._take_state(binding, held, optimizer)
                states.append(binding)
        self.layouts, self.buffers = layouts, buffers
        self._params, self._states, self._pending = bound, states, pending
        self._lanes = [buffers[layout.port] for layout in layouts if layout.kind == "state" and not layout.shapes[0]]
        self._check_lanes()

    @staticmethod
    def _take_param(b: _Binding) -> None:
        data = b.param.data
        if (data.shape, data.dtype, data.device) != (b.view.shape, b.view.dtype, b.view.device):
            raise ConfigurationError(
                f"parameter '{b.name}' is now {data.dtype} {list(data.shape)} on {data.device}; the step was traced "
                f"for {b.view.dtype} {list(b.view.shape)} on {b.view.device} (model.to() or p.data = ... after "
                "transpile()?). Call transpile() again after changing parameters' shape, dtype or device."
            )
        with torch.no_grad():
            b.view.copy_(data)
        b.param.data = b.view

    @staticmethod
    def _take_state(b: _Binding, held: torch.Tensor, optimizer) -> None:
        """Copy a state tensor into its view and bind the view; a sharded optimizer's view takes its slice of a
        tensor still shaped as the parameter (as tracing creates it, or a checkpoint of whole tensors holds it)."""
        lo, hi = b.span
        if held.shape != b.view.shape and held.shape == b.param.shape and b.view.dim() == 1:
            held = held.reshape(-1)[lo:hi]
        if held.shape != b.view.shape or held.device != b.view.device:
            raise ConfigurationError(
                f"optimizer state '{b.name}.{b.key}' is {list(held.shape)} on {held.device}; the step holds it as "
                f"{list(b.view.shape)} on {b.view.device}. Was it loaded from a checkpoint of another model or "
                "mode? step.load_checkpoint() reads any world size; otherwise call transpile() again."
            )
        with torch.no_grad():
            b.view.copy_(held)
        optimizer.state[b.param][b.key] = b.view

    def _check_lanes(self) -> None:
        """Every lane of a run holds the same count, as one update serves them all (one op per lane buffer: a user
        may have edited one count in place)."""
        for lane in self._lanes:
            if lane.numel() > 1 and not torch.equal(lane, lane[:1].expand_as(lane)):
                raise UnsupportedOptimizerError(
                    f"the parameters of one param group hold different step counts {sorted(set(lane.tolist()))[:4]}"
                    " (loaded from different checkpoints?); the transpiler updates a group with one count."
                )
