"""Running a rank's programs: ``DistributedStep``, process groups, the handshake, failures, the cost probe,
trajectories, the compiled and CUDA-graph runners, and periodic checkpoints with the data position a restart
resumes from; replica groups under a torchft quorum; joining the world under torchrun, restarts included."""

from .checkpointer import Checkpointer
from .data_position import DataPosition
from .distributed_step import DistributedStep
from .fault_tolerance import FaultTolerance
from .join_world import init_distributed

__all__ = ["Checkpointer", "DataPosition", "DistributedStep", "FaultTolerance", "init_distributed"]
