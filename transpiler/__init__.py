"""Distributed-training transpiler for PyTorch: trace a training step, rewrite it with passes.

The package is layered (``docs/design.md``): ``graph`` (the step program, passes' toolkit) at the bottom,
``trace`` and the top-level ``passes`` package on it, ``strategies`` (modes to passes and schedules), ``runtime``
(running a rank's programs), then ``api`` and ``cli``. ``errors`` sits below them all. Each layer imports only
the ones below it; ``tests/test_layers.py`` holds both packages to that with import-linter.
"""

from .api import TraceCache, trace_training_step, transpile
from .errors import (
    BatchMismatchError,
    CheckpointError,
    CommunicationError,
    ConfigurationError,
    FactoryError,
    NoQuorumError,
    PipelineSpecError,
    RankMismatchError,
    RetraceWarning,
    TraceMismatchError,
    TranspilerError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
    VerificationError,
)
from .runtime import Checkpointer, DataPosition, DistributedStep, FaultTolerance
from .trace.signature import StepTrace

__all__ = [
    "BatchMismatchError",
    "CheckpointError",
    "Checkpointer",
    "CommunicationError",
    "ConfigurationError",
    "DataPosition",
    "DistributedStep",
    "FactoryError",
    "FaultTolerance",
    "NoQuorumError",
    "PipelineSpecError",
    "RankMismatchError",
    "RetraceWarning",
    "StepTrace",
    "TraceCache",
    "TraceMismatchError",
    "TranspilerError",
    "UnsupportedModelError",
    "UnsupportedOptimizerError",
    "VerificationError",
    "trace_training_step",
    "transpile",
]
