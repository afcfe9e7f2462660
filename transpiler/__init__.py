"""Distributed-training transpiler for PyTorch: trace a training step, rewrite it with passes."""

from .api import transpile
from .errors import (
    BatchMismatchError,
    ConfigurationError,
    FactoryError,
    PipelineSpecError,
    TranspilerError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
    VerificationError,
)
from .runtime import DistributedStep

__all__ = [
    "BatchMismatchError",
    "ConfigurationError",
    "DistributedStep",
    "FactoryError",
    "PipelineSpecError",
    "TranspilerError",
    "UnsupportedModelError",
    "UnsupportedOptimizerError",
    "VerificationError",
    "transpile",
]
