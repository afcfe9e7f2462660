"""Which modes run across the data-parallel dimension of a 2-D mesh, beside a tensor-parallel plan inside it.

Each rank's program holds its shards of the parameters as ordinary tensors, so a mode's passes work on them as
on a whole model: ``fused_allreduce`` averages each shard's gradient over ``dp``, ZeRO slices each shard over
``dp`` (as FSDP2 does on a 2-D mesh), DiLoCo runs its outer step per shard. What needs a whole tensor or a
decision every rank of the world shares is refused here, before anything is traced.
"""

from __future__ import annotations

from typing import Any

import torch

from transpiler.errors import ConfigurationError

from .checks import WHOLE_TENSOR

MODES = ("fused_allreduce", "zero1", "zero2", "zero3", "diloco", "streaming_diloco")
REFUSED_OPTIONS = {  # option -> (the values allowed, why others are not)
    "max_grad_norm": ((0, 0.0), "clipping takes the norm of the whole gradient, and each rank holds shards of it"),
    "loss_scale": (
        ("off",),
        "a loss scale skips a step on an overflow found in this rank's shards only, so the ranks of one "
        "tensor-parallel group could disagree",
    ),
    "replica_size": ((1,), "the replicas of a 2-D data-parallel layout would need a third mesh dimension"),
}


def check_tensor_parallel(
    mode: str, options: dict[str, Any], optimizer: torch.optim.Optimizer, *, fault_tolerance: bool, cuda_graph: bool
) -> None:
    """A ConfigurationError for a mode, option, optimizer or feature that does not run beside a tensor-parallel
    plan (an optimizer of the user's own is checked op by op once traced: ``trace/tensor_parallel.py``)."""
    if mode not in MODES:
        raise ConfigurationError(
            f"mode '{mode}' does not run beside a tensor-parallel plan; these do: {', '.join(MODES)}. Each rank "
            "there holds shards of the parameters, and the others need whole tensors (AdaSum's and DimReduce's "
            "dot products, compressors' and sparsifiers' per-tensor norms and top-k) or exchange what TP splits."
        )
    for name, (allowed, why) in REFUSED_OPTIONS.items():
        if name in options and options[name] not in allowed:
            raise ConfigurationError(
                f"option {name}={options[name]!r} does not run beside a tensor-parallel plan: {why}. Leave it out."
            )
    members = getattr(optimizer, "members", [optimizer])
    whole = [type(m).__name__ for m in members if type(m).__name__ in WHOLE_TENSOR]
    if whole:
        raise ConfigurationError(
            f"{whole[0]} does not run beside a tensor-parallel plan: {WHOLE_TENSOR[whole[0]]}, and each rank "
            "updates its shards of the parameters on their own. Use an element-wise optimizer (SGD, Adam, AdamW...)."
        )
    if fault_tolerance:
        raise ConfigurationError(
            "fault_tolerance= does not run beside a tensor-parallel plan yet: a replica group would have to heal "
            "every rank's shards from the peer of the same tensor-parallel rank. Train without it."
        )
    if cuda_graph:
        raise ConfigurationError(
            "cuda_graph=True is not built beside a tensor-parallel plan: its collectives on the 'tp' group are not "
            "checked under capture. Leave it off (compile=True works)."
        )
