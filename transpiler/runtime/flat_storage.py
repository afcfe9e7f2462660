"""The flat buffers a program declares (``program.flat_buffers``, ``flatten-update``), held between steps.

Each buffer is allocated once; every parameter (``.data``; under ZeRO-3 the slice the model holds) and every
optimizer-state entry it covers is bound to its view, so the user's tensors stay the user's
(``model.parameters()``, ``optimizer.state``, ``state_dict()``, DCP) while the program reads and writes a few flat
tensors. Before each step :meth:`FlatStorage.bind` checks that every tensor is still the view it was bound to.
What breaks that, and what happens:

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from transpiler.errors import ConfigurationError, UnsupportedOptimizerError
from transpiler.graph.program import FlatBuffer

from .sharded_params import held_slice


@dataclass(eq=False)
class _Binding:
    """One tensor of the user's (or the runtime's pass-added state) bound to a view of a flat buffer."""

    name: str
    param: torch.nn.Parameter
    key: str  # "" for the parameter itself
    view: torch.Tensor
    pointer: int
    span: tuple[int, int]  # the parameter's elements the view holds (a sharded optimizer's slice)
    whole: torch.Size  # the parameter's whole shape (ZeRO-3 holds the parameter itself as its slice)


def _overlaps(a: FlatBuffer, b: FlatBuffer) -> bool:
    """Whether two layouts bind some of the same tensors (one must give way to the other)."""
    return (a.kind, a.key) == (b.kind, b.key) and not set(a.names).isdisjoint(b.names)


class FlatStorage:
    """The flat buffers of the programs that ran, and the views the tensors they cover are bound to.

    Layouts are bound one by one: a program that declares a layout already bound (LocalSGD's two variants share
    their parameters' buffers; only the sync variant adds a snapshot buffer) moves nothing, and a layout that
    covers tensors another bound layout holds (a retrace, a freeze schedule's variant) takes its place."""

    def __init__(self) -> None:
        self._bound: dict[FlatBuffer, list[_Binding]] = {}
        self._kept: dict[FlatBuffer, torch.Tensor] = {}  # the buffer of each layout once used, for one coming back
        self._pending: list[_Binding] = []  # state views the next step writes first (not in optimizer.state yet)

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The bound buffers by port name (what the program's ``flat`` inputs are fed)."""
        return {layout.port: self._kept[layout] for layout in self._bound}

    def bind(
        self,
        layouts: Iterable[FlatBuffer],
        params: dict[str, torch.nn.Parameter],
        optimizer,
        extra: dict[str, torch.Tensor],
        whole: Mapping[str, torch.Size],
    ) -> None:
        """Before a step: the buffers ``layouts`` declare exist, and every tensor they cover is bound to its view
        (copied in where the user replaced it, or where another layout held it). ``extra`` is the runtime's
        pass-added state, which a ``kind="extra"`` layout binds by ``"<key>.<parameter>"``; ``whole``, the whole
        shape of each parameter the model holds as a slice (ZeRO-3)."""
        for layout in layouts:
            if layout not in self._bound:
                self._activate(layout, params, optimizer, extra, whole)
        for layout, bindings in self._bound.items():
            if layout.kind == "param":
                for b in bindings:
                    if b.param.data_ptr() != b.pointer:
                        self._take_param(b)
            elif layout.kind == "extra":
                for b in bindings:
                    if extra.get(f"{b.key}.{b.name}") is not b.view:
                        self._take_extra(b, extra)
            else:
                self._check_state(bindings, optimizer)
        self._check_lanes()

    def written(self, optimizer, skipped: bool) -> None:
        """After a step that updated (``skipped`` False): the state entries it created are bound to their views."""
        if skipped or not self._pending:
            return
        for b in self._pending:
            optimizer.state[b.param][b.key] = b.view
        self._pending.clear()

    # ------------------------------------------------------------------ internals
    def _activate(
        self,
        layout: FlatBuffer,
        params: dict[str, torch.nn.Parameter],
        optimizer,
        extra: dict[str, torch.Tensor],
        whole: Mapping[str, torch.Size],
    ) -> None:
        """Bind everything ``layout`` covers to its buffer (made once per layout, kept for one that comes back),
        copying the current values in; a bound layout that covers some of the same tensors gives way."""
        for other in [o for o in self._bound if _overlaps(o, layout)]:
            gone = self._bound.pop(other)
            self._pending = [b for b in self._pending if b not in gone]
        buffer = self._kept.get(layout)
        if buffer is None:
            buffer = torch.zeros(layout.length, dtype=getattr(torch, layout.dtype), device=layout.device)
            self._kept[layout] = buffer
        bindings = []
        for name, start, shape, span in zip(layout.names, layout.starts, layout.shapes, layout.spans):
            numel = int(torch.Size(shape).numel())
            view = buffer[start : start + numel].view(shape)
            param = params[name]
            binding = _Binding(name, param, layout.key, view, view.data_ptr(), span, whole.get(name, param.shape))
            bindings.append(binding)
            if layout.kind == "param":
                self._take_param(binding)
            elif layout.kind == "extra":
                self._take_extra(binding, extra)
            elif (held := optimizer.state[params[name]].get(layout.key)) is None:
                self._pending.append(binding)
            else:
                self._take_state(binding, held, optimizer)
        self._bound[layout] = bindings

    def _check_state(self, bindings: list[_Binding], optimizer) -> None:
        """Each state entry is still its view: one replaced is copied in, one removed is zeroed and bound again
        when the next step writes it (as eager creates state on its first step)."""
        state = optimizer.state
        for b in bindings:
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

    @staticmethod
    def _take_param(b: _Binding) -> None:
        data = b.param.data
        if data.shape == b.whole != b.view.shape:
            raise ConfigurationError(
                f"parameter '{b.name}' was given a whole tensor {list(data.shape)}; under zero3 the model holds this "
                f"rank's 1-D slice of it between steps ({list(b.view.shape)}). Assign whole parameters inside `with "
                "step.gathered():` (every rank enters it), which keeps each rank's slice of them."
            )
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
        tensor still as large as the whole parameter (as tracing creates it, or a checkpoint of whole tensors holds
        it)."""
        if held.shape != b.view.shape and held.shape == b.whole and b.view.dim() == 1:
            held = held_slice(held, held.numel(), b.span)
        if held.shape != b.view.shape or held.device != b.view.device:
            raise ConfigurationError(
                f"optimizer state '{b.name}.{b.key}' is {list(held.shape)} on {held.device}; the step holds it as "
                f"{list(b.view.shape)} on {b.view.device}. Was it loaded from a checkpoint of another model or "
                "mode? step.load_checkpoint() reads any world size; otherwise call transpile() again."
            )
        with torch.no_grad():
            b.view.copy_(held)
        optimizer.state[b.param][b.key] = b.view

    @staticmethod
    def _take_extra(b: _Binding, extra: dict[str, torch.Tensor]) -> None:
        """Copy pass-added state (a LocalSGD snapshot, made by its rule before the step) into its view and hold
        the view in its place, so checkpoints keep one tensor per parameter whatever the layout."""
        name = f"{b.key}.{b.name}"
        held = extra.get(name)
        if held is None or held.shape != b.view.shape or held.dtype != b.view.dtype:
            raise ConfigurationError(
                f"the step's state '{name}' is {'missing' if held is None else f'{held.dtype} {list(held.shape)}'}"
                f"; the step holds it as {b.view.dtype} {list(b.view.shape)}. Was it loaded from a checkpoint of "
                "another model?"
            )
        with torch.no_grad():
            b.view.copy_(held)
        extra[name] = b.view

    def _check_lanes(self) -> None:
        """Every lane of a run holds the same count, as one update serves them all (one op per lane buffer: a user
        may have edited one count in place)."""
        lanes = [self._kept[x] for x in self._bound if x.kind == "state" and not x.shapes[0]]
        for lane in lanes:
            if lane.numel() > 1 and not torch.equal(lane, lane[:1].expand_as(lane)):
                raise UnsupportedOptimizerError(
                    f"the parameters of one param group hold different step counts {sorted(set(lane.tolist()))[:4]}"
                    " (loaded from different checkpoints?); the transpiler updates a group with one count."
                )
