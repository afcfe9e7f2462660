"""The layouts a plan weighs, and each one as what ``transpile()`` takes: a mode's config, a pipeline, a budget.

The space, at world size W: the data-parallel modes over all W ranks (``fused_allreduce``, ``zero1``, ``zero2``,
``zero3``), each also with the least recompute budget; the low-communication modes at the settings this
project measured them with (``diloco`` H = 15 and 50; ``streaming_diloco`` int4, H = 50, 4 fragments, τ = 1;
``sparseloco`` and ``demo`` at their authors' settings; Streaming DiLoCo in fewer fragments where the model has
fewer than 4 modules with trainable parameters, as a fragment holds whole modules); and a 1F1B pipeline of every
stage count that divides W and that the model has blocks for, with ``fused_allreduce`` across its data-parallel
replicas. On a GPU whose
programs a calibration measured, each data-parallel mode without a budget also runs captured (``cuda_graph``),
and compiled and compiled and captured where the compiled program was measured. A layout the
project refuses for this model and optimizer (the mode's own checks) or cannot build yet (a budget beside a
pipeline) is listed with the reason. Where the user gives the model's tensor-parallel plan, each degree ``tp`` that
divides both W and a host's ranks runs the data-parallel modes over the ``W / tp`` groups (without a plan, or
where a group would span hosts, the degree is listed with the reason).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from passes.partitions import module_sizes
from transpiler.errors import ConfigurationError
from transpiler.runtime.execution import Execution
from transpiler.strategies.checks import Elementwise
from transpiler.strategies.mode_config import ModeConfig, Surroundings
from transpiler.strategies.modes import mode_config
from transpiler.strategies.pipeline_parallel import PipelineParallel
from transpiler.trace.optimizers import TWINS

from .cluster import Cluster
from .costs import DATA_PARALLEL, Estimate, Layout
from .profile import StepProfile

# the settings each low-communication mode was measured at (bench/wan.py), which its steps factor belongs to
SETTINGS = {
    "diloco": {},
    "streaming_diloco": {
        "sync_every": 50,
        "fragments": 4,
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.5,
        "exchange_dtype": "int4",
    },
    "sparseloco": {},
    "demo": {},
}
DILOCO_PERIODS = (15, 50)


@dataclass(frozen=True)
class Candidate:
    """A layout with its estimate, which ``transpile(model, optimizer, candidate, ...)`` runs (``transpile_arguments``:
    its ``config``, ``pipeline`` and ``execution``). A pipeline's ``example_inputs`` is its batch: ``pp`` of the
    example batches the plan was made for."""

    layout: Layout
    estimate: Estimate
    config: ModeConfig
    pipeline: PipelineParallel | None = None

    @property
    def label(self) -> str:
        return self.layout.label

    @property
    def execution(self) -> Execution:
        layout = self.layout
        return Execution(memory_budget=layout.memory_budget, compile=layout.compile, cuda_graph=layout.cuda_graph)

    def apply_tensor_parallel(self, model: torch.nn.Module, tp_plan: dict):
        """Under torchrun, for a tensor-parallel pick: a ``("dp", "tp")`` mesh of this pick's shape (on the GPUs
        under NCCL), the plan applied to ``model`` over its ``tp`` groups (``parallelize_module``); returns
        ``mesh["dp"]``, what ``transpile(..., mesh=)`` takes. Build the optimizer after it (it must hold the
        shards). None for a pick without tensor parallelism."""
        if self.layout.tp == 1:
            return None
        mesh = init_device_mesh(_device(), (self.layout.dp, self.layout.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        return mesh["dp"]

    def transpile_arguments(
        self, execution: Execution | None, mesh, pipeline: PipelineParallel | None
    ) -> tuple[ModeConfig, Execution, object, PipelineParallel | None]:
        """What ``transpile(model, optimizer, candidate, ...)`` runs: this candidate's config and pipeline, the
        ``execution`` given (or the default) with this candidate's budget and flags, and under torchrun a
        ``("pp", "dp")`` mesh where the pipeline has replicas and no mesh was given."""
        if pipeline is not None:
            raise ConfigurationError(
                f"the plan's pick ({self.label}) sets the pipeline itself: leave pipeline= out, or give a mode's "
                "config instead of the pick."
            )
        layout = self.layout
        flags = {"memory_budget": layout.memory_budget, "compile": layout.compile, "cuda_graph": layout.cuda_graph}
        execution = dataclasses.replace(execution, **flags) if execution is not None else self.execution
        if layout.tp > 1 and mesh is None:
            raise ConfigurationError(
                f"the plan's pick ({self.label}) is tensor parallel: mesh = pick.apply_tensor_parallel(model, "
                "tp_plan), then build the optimizer on the model's parameters (its shards now), and give "
                "transpile(..., mesh=mesh)."
            )
        if self.pipeline is not None and layout.dp > 1 and mesh is None:
            mesh = init_device_mesh(_device(), (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
        return self.config, execution, mesh, self.pipeline


def _device() -> str:
    return "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"


@dataclass(frozen=True)
class Rejected:
    """A layout left out, and why: over memory (with its estimate), or refused by the project's checks."""

    label: str
    reason: str
    estimate: Estimate | None = None


def layouts(profile: StepProfile, cluster: Cluster) -> tuple[list[Layout], list[Rejected]]:
    """Every layout of the space on ``cluster`` (module docstring), and those that cannot be built yet."""
    space, refused = _layouts(profile, cluster.world_size, cluster.ranks_per_host)
    if not cluster.programs:
        return space, refused
    flags = [(False, True)]
    if "compile" in cluster.programs:
        flags += [(True, False), (True, True)]
    else:
        refused.append(
            Rejected("compiled", "the compiled program was not measured: transpiler calibrate --compile on the GPU")
        )
    flagged = [
        dataclasses.replace(layout, compile=compiled, cuda_graph=captured)
        for layout in space
        if layout.mode in DATA_PARALLEL and layout.pp == 1 and layout.tp == 1 and layout.memory_budget is None
        for compiled, captured in flags
    ]
    return space + flagged, refused


def _layouts(profile: StepProfile, world: int, ranks_per_host: int) -> tuple[list[Layout], list[Rejected]]:
    if world == 1:
        return [Layout("fused_allreduce", 1)], []
    out: list[Layout] = []
    for mode in ("fused_allreduce", "zero1", "zero2", "zero3"):
        out += [Layout(mode, world), *(Layout(mode, world, memory_budget=r.budget) for r in profile.recompute)]
    out += [Layout("diloco", world, sync_every=h) for h in DILOCO_PERIODS]
    modules = len(module_sizes(list(profile.parameters)))  # a fragment holds whole modules
    out += [Layout("streaming_diloco", world, sync_every=50, fragments=min(4, modules))]
    out.append(Layout("sparseloco", world, sync_every=15))
    out.append(Layout("demo", world))
    more, refused = _tensor_parallel(profile, world, ranks_per_host)
    out += more
    for pp in (p for p in range(2, world + 1) if world % p == 0):
        label = f"pipeline pp={pp}×dp={world // pp}"
        if profile.blocks < pp:
            refused.append(Rejected(label, f"the model has {profile.blocks} blocks to cut at, {pp} stages need {pp}"))
            continue
        batch = profile.batch_size * pp
        m = next((m for m in (2 * pp, pp) if batch % m == 0), None)
        if m is None:
            refused.append(Rejected(label, f"its batch of {batch} does not cut into {pp} or {2 * pp} microbatches"))
            continue
        out.append(Layout("none" if pp == world else "fused_allreduce", world // pp, pp, m))
        if profile.recompute:
            refused.append(Rejected(f"{label}, recompute", "a memory budget beside a pipeline is not supported yet"))
    return out, refused


def _tensor_parallel(profile: StepProfile, world: int, ranks_per_host: int) -> tuple[list[Layout], list[Rejected]]:
    """Each tensor-parallel degree that divides the world: the data-parallel modes over the groups (one mode where
    there is one group), where the user gave a plan and a group fits in a host."""
    out, refused = [], []
    for tp in (t for t in range(2, world + 1) if world % t == 0):
        if profile.tensor_parallel is None:
            refused.append(Rejected(f"tp={tp}", "give plan(..., tp_plan=) the model's parallelize_module plan"))
        elif ranks_per_host % tp:
            refused.append(
                Rejected(
                    f"tp={tp}",
                    f"a group of {tp} would span hosts of {ranks_per_host} rank(s): its exchanges run "
                    "every layer, so tp divides the ranks of a host",
                )
            )
        else:
            out += [Layout(mode, world // tp, tp=tp) for mode in (DATA_PARALLEL if world > tp else DATA_PARALLEL[:1])]
    return out, refused


def config_of(layout: Layout) -> tuple[ModeConfig, PipelineParallel | None]:
    """The mode's config and the pipeline a layout stands for."""
    options = dict(SETTINGS.get(layout.mode, {}))
    if layout.sync_every is not None and layout.mode != "streaming_diloco":
        options["sync_every"] = layout.sync_every
    if layout.mode == "streaming_diloco":
        options["fragments"] = layout.fragments
    config = mode_config(layout.mode, **options)
    pipeline = PipelineParallel(stages=layout.pp, microbatches=layout.microbatches) if layout.pp > 1 else None
    return config, pipeline


def refusal(layout: Layout, config: ModeConfig, pipeline: PipelineParallel | None, optimizer) -> str | None:
    """What the project's own checks at ``transpile()`` say against this layout for this optimizer, or None."""
    if layout.cuda_graph and type(optimizer) not in TWINS:
        return (
            f"cuda_graph=True: {type(optimizer).__name__} takes the generic path, whose step sizes are computed in "
            "Python each step (SGD, Adam and AdamW capture)"
        )
    try:
        if layout.tp > 1:
            Elementwise("tensor parallel")(optimizer)
        surroundings = Surroundings(pipeline=pipeline is not None, tensor_parallel=layout.tp > 1)
        config.strategy(surroundings).check(optimizer)
    except ConfigurationError as error:
        return str(error)
    return None
