"""``fuse-allreduce``: coalesce gradients into buckets, one all-reduce per bucket.

Requires: gradient nodes tagged ``grad_of`` (not yet reduced).
Guarantees: gradients are grouped in production order into buckets that
never mix dtypes or devices and stay within the byte cap (a gradient larger
than the cap gets a bucket of its own); the first bucket of each dtype uses
``first-bucket-mb`` as DDP does. A bucket is flattened into one buffer, reduced
once and read back through views; a one-gradient bucket is reduced in place of
the gradient, without copies. With ``gradient-as-bucket-view`` (the default) a bucket is a persistent
buffer the gradients are produced or copied into (``bucket_views.py``), so no step allocates one.
``bucket-cap-mb=0`` gives one bucket per gradient; ``bucket-cap-mb=auto`` picks both caps on the cost
model measured at startup (``transpiler/graph/cost_model.py``, ``bucket_plan.py``) and says what it chose in
``program.decisions``. Each all-reduce carries ``meta["collective"]`` with its members.
With ``wire-dtype=fp16|bf16`` each bucket is cast to half precision, reduced
and cast back; the gradients are already each rank's share (``scale-loss-grad``
ran before), so the sum cannot overflow where the mean does not.
With ``across`` (replica groups of several ranks under a torchft quorum) each bucket, once reduced in the group,
is summed again over axis ``across``: the same bucket of the other groups, on torchft's process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from transpiler.graph.options import option
from transpiler.graph.pipeline import ReducingPass
from transpiler.graph.program import StepProgram

from .bucket_plan import choose_caps
from .bucketing import (
    DEFAULT_CAP_MB,
    MB,
    WIRE,
    across_option,
    bucket_cap_option,
    bucket_key,
    caps_in_bytes,
    first_bucket_option,
    reduce_in_buckets,
    wire_dtype_option,
)
from .gradient_flow import replace_gradient, unreduced_gradients


@dataclass(frozen=True)
class FuseAllReduce(ReducingPass):
    name = "fuse-allreduce"
    summary = "coalesce gradients into dtype/size buckets, one all-reduce per bucket"
    bucket_cap_mb: float | str = bucket_cap_option(("auto", "picks both caps from a cost model measured at startup"))
    first_bucket_mb: float = first_bucket_option()
    wire_dtype: str = wire_dtype_option()
    gradient_as_bucket_view: bool = option(
        True, help="write gradients into persistent bucket buffers and read them back as views (DDP's option)"
    )
    across: bool = across_option("each reduced bucket")

    def run(self, program: StepProgram) -> bool:
        grads = unreduced_gradients(program)
        if not grads:
            return False
        items = [(g.meta["grad_of"], g) for g in grads]
        cap, first = self._caps(program, grads)
        for grad, reduced in zip(
            grads,
            reduce_in_buckets(
                program,
                items,
                cap,
                first,
                tag="grads",
                compress=WIRE[self.wire_dtype],
                bucket_views=self.gradient_as_bucket_view,
                across=self.across,
            ),
        ):
            replace_gradient(grad, reduced)
        return True

    @property
    def wants_cost_model(self) -> bool:
        return self.bucket_cap_mb == "auto"

    def _caps(self, program: StepProgram, grads: list[fx.Node]) -> tuple[int, int]:
        """The caps in bytes: as given, or chosen on the program's cost model (defaults without one)."""
        if not self.wants_cost_model:
            return caps_in_bytes(self.bucket_cap_mb, self.first_bucket_mb)
        if program.cost_model is None:
            program.decisions[self.name] = (
                "bucket_cap_mb=auto fell back to 25 MiB (first 1 MiB): no cost model, which is measured only "
                "when the step runs in a world of more than one process"
            )
            return int(DEFAULT_CAP_MB * MB), MB
        wire = WIRE[self.wire_dtype]
        nbytes = [g.meta["val"].numel() * (wire or g.meta["val"].dtype).itemsize for g in grads]
        choice = choose_caps(
            program.cost_model, [g.meta["grad_of"] for g in grads], nbytes, [bucket_key(g) for g in grads]
        )
        program.decisions[self.name] = choice.describe()
        return caps_in_bytes(choice.bucket_cap_mb, choice.first_bucket_mb)
