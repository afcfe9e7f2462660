"""``fuse-allreduce``: coalesce gradients into buckets, one all-reduce per bucket.

Requires: gradient nodes tagged ``grad_of`` (not yet reduced).
Guarantees: gradients are grouped in production order into buckets that
never mix dtypes or devices and stay within the byte cap (a gradient larger
than the cap gets a bucket of its own); the first bucket of each dtype uses
``first-bucket-mb`` as DDP does. A bucket is flattened into one buffer, reduced
once and read back through views; a one-gradient bucket is reduced in place of
the gradient, without copies. ``bucket-cap-mb=0`` gives one bucket per
gradient. Each all-reduce carries ``meta["collective"]`` with its members.
With ``compress=fp16|bf16`` each bucket is cast to half precision, reduced
and cast back; the gradients are already each rank's share (``scale-loss-grad``
ran before), so the sum cannot overflow where the mean does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from transpiler.pipeline import Pass
from transpiler.program import StepProgram

from .bucketing import (
    MB,
    WIRE,
    bucket_cap_option,
    compress_option,
    first_bucket_option,
    reduce_in_buckets,
)
from .gradient_flow import replace_gradient, unreduced_gradients


@dataclass(frozen=True)
class FuseAllReduce(Pass):
    name = "fuse-allreduce"
    summary = "coalesce gradients into dtype/size buckets, one all-reduce per bucket"
    reduces_gradients = True
    bucket_cap_mb: float = bucket_cap_option()
    first_bucket_mb: float = first_bucket_option()
    compress: str = compress_option()

    def run(self, program: StepProgram) -> bool:
        grads = unreduced_gradients(program)
        if not grads:
            return False
        items = [(g.meta["grad_of"], g) for g in grads]
        cap, first = int(self.bucket_cap_mb * MB), int(self.first_bucket_mb * MB)
        for grad, reduced in zip(
            grads, reduce_in_buckets(program, items, cap, first, tag="grads", compress=WIRE[self.compress])
        ):
            replace_gradient(grad, reduced)
        return True
