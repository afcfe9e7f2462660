"""Distributed-training transpiler for PyTorch: trace a training step, rewrite it with passes.

The package is layered (``docs/design.md``): ``graph`` (the step program, passes' toolkit) at the bottom,
``trace`` and the top-level ``passes`` package on it, ``strategies`` (modes to passes and schedules), ``runtime``
(running a rank's programs), then ``api`` and ``cli``. ``errors`` sits below them all. Each layer imports only
the ones below it; ``tests/test_layers.py`` holds both packages to that with import-linter.

A step is ``transpile(model, optimizer, config, loss_fn, example_inputs)`` with ``config`` one mode's config
(``ZeRO(stage=3)``, ``DiLoCo(sync_every=50)``...), the features it takes as its fields
(``accumulation=Accumulation(steps=4)``), and the execution settings beside it (``execution=Execution(...)``).
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
    RenamedWarning,
    RetraceWarning,
    TraceMismatchError,
    TranspilerError,
    UnsupportedModelError,
    UnsupportedOptimizerError,
    VerificationError,
)
from .runtime import Checkpointer, DataPosition, DistributedStep, FaultTolerance, init_distributed
from .runtime.execution import Execution
from .runtime.process_group import StaticWorld
from .strategies.data_parallel import AdaSum, AllGather, DataParallel, DeMo, DimReduce, NoSync, ZeRO
from .strategies.diloco import DiLoCo, SparseLoCo, StreamingDiLoCo
from .strategies.features import Accumulation, Clipping, Compression, Freeze, LossScaling, Sparsification
from .strategies.local_updates import LocalSGD, PartialSync
from .strategies.mode_config import ModeConfig
from .strategies.modes import PassPipeline, config_from_dict, load_config, mode_config
from .strategies.pipeline_parallel import PipelineParallel
from .trace.signature import StepTrace

__all__ = [
    "Accumulation",
    "AdaSum",
    "AllGather",
    "BatchMismatchError",
    "CheckpointError",
    "Checkpointer",
    "Clipping",
    "CommunicationError",
    "Compression",
    "ConfigurationError",
    "DataParallel",
    "DataPosition",
    "DeMo",
    "DiLoCo",
    "DimReduce",
    "DistributedStep",
    "Execution",
    "FactoryError",
    "FaultTolerance",
    "Freeze",
    "LocalSGD",
    "LossScaling",
    "ModeConfig",
    "NoQuorumError",
    "NoSync",
    "PartialSync",
    "PassPipeline",
    "PipelineParallel",
    "PipelineSpecError",
    "RankMismatchError",
    "RenamedWarning",
    "RetraceWarning",
    "SparseLoCo",
    "Sparsification",
    "StaticWorld",
    "StepTrace",
    "StreamingDiLoCo",
    "TraceCache",
    "TraceMismatchError",
    "TranspilerError",
    "UnsupportedModelError",
    "UnsupportedOptimizerError",
    "VerificationError",
    "ZeRO",
    "config_from_dict",
    "init_distributed",
    "load_config",
    "mode_config",
    "trace_training_step",
    "transpile",
]
