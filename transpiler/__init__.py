"""Distributed-training transpiler for PyTorch: trace a training step, rewrite it with passes.

``transpile`` and ``DistributedStep`` are loaded on first use, so that the
pass modules (``passes/``) can import the pass infrastructure from this
package without a circular import through the modes that list them.
"""

from typing import Any

from .errors import (
    CheckpointError,
    CommunicationError,
    ConfigurationError,
    FactoryError,
    PipelineSpecError,
    RankMismatchError,
    RetraceWarning,
    TranspilerError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
    VerificationError,
)

__all__ = [
    "CheckpointError",
    "CommunicationError",
    "ConfigurationError",
    "DistributedStep",
    "FactoryError",
    "PipelineSpecError",
    "RankMismatchError",
    "RetraceWarning",
    "TranspilerError",
    "UnsupportedModelError",
    "UnsupportedOptimizerError",
    "VerificationError",
    "transpile",
]


def __getattr__(name: str) -> Any:
    if name == "transpile":
        from .api import transpile

        return transpile
    if name == "DistributedStep":
        from .runtime import DistributedStep

        return DistributedStep
    raise AttributeError(f"module 'transpiler' has no attribute {name!r}")
