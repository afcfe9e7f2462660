"""What must hold before a program first runs: a process group it can run on, every rank agreeing on its setup
(the handshake, again for each program with a new setup), and the startup program (``broadcast-params``) run
once, so every rank starts from rank 0's weights."""

from __future__ import annotations

import torch

from .failures import run_named
from .handshake import Handshake
from .process_group import Placement, require_live
from .program_cache import Built
from .step_state import StepState


class Startup:
    """The handshake of a world of several ranks, and which setup the ranks last agreed on."""

    def __init__(self, placement: Placement) -> None:
        multi = placement.live and placement.world_size > 1
        self.handshake = (
            Handshake(placement.rank, placement.world_size, placement.timeout, placement.group_name) if multi else None
        )
        self.agreed: bytes | None = None  # the digest of the setup the ranks last agreed on

    def ready(self, state: StepState, built: Built) -> None:
        """Before ``built``'s programs run: the group is live, the ranks agree on its setup, the startup ran."""
        require_live(state.placement)
        if self.handshake is not None and built.digest != self.agreed:
            self.handshake.agree(built.setup)
            self.agreed = built.digest
        if not state.started:
            run_startup(state, built)


def run_startup(state: StepState, built: Built) -> None:
    """The first variant's startup program that has one (rank 0's parameters and buffers broadcast), in place."""
    state.started = True
    program = next((p for p in built.programs.values() if p.startup is not None), None)
    if program is None:
        return
    tensors = {"param": built.params, "frozen": built.frozen, "buffer": built.buffers}
    targets = [tensors[port.kind][port.name] for port in program.startup_ports]
    with torch.no_grad():
        gm = program.startup
        results = run_named(gm, gm, [t.detach() for t in targets], "startup", state.placement)
        for target, value in zip(targets, results):
            target.copy_(value)
