"""Per-step scalars as 0-d tensors that keep their storage from step to step.

An optimizer twin's slots (``-lr``, Adam's step size and bias correction) change every step. Fed as Python
floats they would be baked into a compiled program (Dynamo specialises on them and recompiles each step) or a
captured CUDA graph. A :class:`ScalarBank` holds them as 0-d views of one float64 vector on the parameters'
device: one host-to-device copy per step fills them all in place, and their addresses never change, so one
compiled or captured program serves every step.
"""

from __future__ import annotations

import torch


class ScalarBank:
    """The scalar inputs of one program, by port name, as persistent 0-d float64 tensors."""

    def __init__(self, names: list[str], device: torch.device):
        self.names = list(names)
        self.device = device
        self.vector = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self.views = {name: self.vector[i] for i, name in enumerate(self.names)}

    def fill(self, values: dict[str, float]) -> dict[str, torch.Tensor]:
        """Write this step's values in place (one copy) and return the views."""
        host = torch.tensor([values[name] for name in self.names], dtype=torch.float64)
        if self.device.type == "cuda":  # pinned, so the copy is asynchronous and ordered on the stream
            host = host.pin_memory()
        self.vector.copy_(host, non_blocking=self.device.type == "cuda")
        return self.views
