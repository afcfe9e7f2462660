"""``Execution``: how a step's programs are built and run, whatever the mode (``transpile(..., execution=...)``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from transpiler.errors import ConfigurationError
from transpiler.graph.config import Config, own
from transpiler.graph.program import StepProgram


@dataclass(frozen=True, kw_only=True, repr=False)
class Execution(Config):
    """The execution settings of a step: compiled or captured, its timeout, how many programs it keeps, the host's
    memory, verification, and what it shows or saves on the way.

    ``compile``: each rewritten program compiled with ``torch.compile`` (Inductor) on its first call
    (``runtime/compile.py``; ``step.compile_seconds`` says how long). ``cuda_graph`` (NCCL, a model on the GPU,
    SGD, Adam or AdamW): each program captured as a CUDA graph after two warm-up steps and replayed, bitwise the
    uncaptured step (``runtime/cuda_graph.py``); it composes with ``compile``. ``timeout`` (seconds, or a
    timedelta) bounds every collective of the step and the startup handshake; None: the default group's (torch's
    default is 30 minutes). ``max_cached_programs`` bounds the programs kept for different batch shapes and model
    modes. ``keep_freed_memory`` (the CPU): glibc keeps the memory a step frees for the next step, sized by what
    the step holds at once, as the CUDA caching allocator does (process-wide; ``runtime/host_memory.py``).
    ``verify``: the verifiers between passes and the static cross-rank checks. ``on_pass(spec, program)`` is
    called after every pass. ``save_trajectory=DIR``: rank 0 saves the flattened weights every
    ``trajectory_every`` updates, for ``transpiler pca`` (``runtime/trajectory.py``). ``memory_budget`` (a fraction
    of the peak bytes of the step's own tensors without recompute; 0: the least reachable) or
    ``memory_budget_bytes``: the ``recompute`` pass runs once on the traced step and recomputes forward values in
    the backward until that peak fits, bitwise the same step (``passes/recompute.py``, docs/memory.md)."""

    compile: bool = own(False, help="compile each program with torch.compile on its first call")
    cuda_graph: bool = own(False, help="capture each program as a CUDA graph and replay it")
    timeout: float | None = own(None, kind=float, help="seconds every collective and the handshake may take")
    max_cached_programs: int = own(8, minimum=1, help="programs kept for different batch shapes and model modes")
    keep_freed_memory: bool = own(True, help="on the CPU, glibc keeps the memory a step frees for the next")
    verify: bool = own(True, help="verify the graph between passes and all ranks' programs against each other")
    on_pass: Callable[[str, StepProgram], None] | None = dataclasses.field(default=None)
    save_trajectory: str | None = own(None, kind=str, help="rank 0 saves the flattened weights into this directory")
    trajectory_every: int = own(1, minimum=1, help="every this many optimizer updates")
    memory_budget: float | None = own(
        None,
        kind=float,
        minimum=0,
        maximum=1,
        help="the step's own peak bytes as a fraction of those without recompute",
    )
    memory_budget_bytes: int | None = own(None, kind=int, minimum=1, help="the step's own peak bytes, in bytes")

    def __post_init__(self) -> None:
        if isinstance(self.timeout, timedelta):
            object.__setattr__(self, "timeout", self.timeout.total_seconds())
        super().__post_init__()

    def check(self) -> None:
        if self.timeout is not None and not 0 < self.timeout < float("inf"):
            raise ConfigurationError(f"timeout must be positive and finite seconds, got {self.timeout!r}.")
        if self.on_pass is not None and not callable(self.on_pass):
            raise ConfigurationError(f"on_pass must be callable as on_pass(spec, program), got {self.on_pass!r}.")
        if self.memory_budget is not None and self.memory_budget_bytes is not None:
            raise ConfigurationError("give memory_budget (a fraction) or memory_budget_bytes, not both.")
        if self.trajectory_every != 1 and not self.save_trajectory:
            raise ConfigurationError("trajectory_every only applies with save_trajectory=DIR; give both or neither.")

    @property
    def timeout_delta(self) -> timedelta | None:
        return timedelta(seconds=self.timeout) if self.timeout is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The settings by name (``on_pass`` left out: a function is no data)."""
        return {k: v for k, v in super().to_dict().items() if k != "on_pass"}
