"""Running a rank's programs: ``DistributedStep``, process groups, the handshake, failures, the cost probe,
trajectories, and the compiled and CUDA-graph runners."""

from .distributed_step import DistributedStep

__all__ = ["DistributedStep"]
