"""The base of every mode's config: its names, what it runs beside, and how it becomes a strategy.

``config.strategy(surroundings)`` is the one place a mode is checked against what the step runs in (a
tensor-parallel plan, a torchft quorum, CUDA graphs) and built: its recipe (the config's own passes and schedule),
the wrapping features woven in (``composition.py``), and, under a quorum, the strategy rewritten for one replica
group (:meth:`Strategy.under_quorum`). What each mode's config adds is its :meth:`ModeConfig.recipe` and, where
its fields matter there, :meth:`ModeConfig.refusal`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from transpiler.errors import ConfigurationError

from .composition import Wrapping, compose
from .config import PassKnobs
from .strategy import Recipe, Strategy

M = TypeVar("M", bound="ModeConfig")

# the modes that run beside a tensor-parallel plan, and under a torchft quorum (docs/strategies/tensor_parallel.md,
# docs/fault_tolerance.md); every other one is refused there, saying which do
TENSOR_PARALLEL_MODES = ("fused_allreduce", "zero1", "zero2", "zero3", "diloco", "streaming_diloco")
# beside a pipeline (docs/strategies/pipeline.md)
PIPELINE_MODES = ("none", "fused_allreduce", "zero1", "zero2", "zero3", "diloco")
PIPELINE_FEATURES = ("clipping",)  # the wrapping features built beside one: the stages' norms meet by an all-reduce
QUORUM_MODES = ("allreduce", "fused_allreduce", "zero1", "zero2", "zero3", "diloco", "streaming_diloco")


@dataclass(frozen=True)
class ModeName:
    """One name of ``transpiler modes``: a summary, the fields the name sets (``zero3``: ``stage=3``), and the
    fields of its config the mode does not take (they stay at their defaults), with why."""

    name: str
    summary: str
    implied: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    without: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class Surroundings:
    """What a step runs in, as far as a mode's fit goes."""

    tensor_parallel: bool = False  # the model is under torch's tensor-parallel plan
    quorum_group: int | None = None  # under a torchft quorum: the ranks of this replica group
    async_quorum: bool = False  # the quorum taken beside the step (FaultTolerance.async_quorum)
    cuda_graph: bool = False
    compiled: bool = False  # each program compiled (Inductor orders an op that returns nothing by its data only)
    pipeline: bool = False  # the step is one stage of a pipeline


ALONE = Surroundings()  # a step by itself: no tensor-parallel plan, no quorum, no CUDA graphs


@dataclass(frozen=True, kw_only=True, repr=False)
class ModeConfig(PassKnobs):
    """Base of the modes' configs: ``transpile(model, optimizer, config, ...)``."""

    names: ClassVar[tuple[ModeName, ...]] = ()
    # under a quorum, its reductions are made in the group, then summed across the groups (for a group of any size;
    # data parallel only for a group of several ranks, since one rank sums across the groups directly)
    two_levels_under_quorum: ClassVar[bool] = False
    # under a quorum, its update writes nothing before its last collective, so it may run in place, held back until
    # the vote is counted (overlap-quorum); a ZeRO update precedes its all-gather, and stays functional
    in_place_under_quorum: ClassVar[bool] = False

    @property
    def mode(self) -> str:
        """This config's name in ``transpiler modes``."""
        for entry in self.names:
            if all(getattr(self, k) == v for k, v in entry.implied.items()):
                return entry.name
        raise AssertionError(f"{type(self).__name__} names no mode for {self!r}")  # names cover every value

    def __post_init__(self) -> None:
        super().__post_init__()
        entry = next((e for e in self.names if e.name == self.mode), None)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [name for name in entry.without if getattr(self, name) != defaults[name]] if entry else []
        if changed:
            written = ", ".join(f"{k}={v!r}" for k, v in entry.implied.items())
            raise ConfigurationError(
                f"mode '{self.mode}' ({type(self).__name__}({written})) takes no {', '.join(changed)}: {entry.why}. "
                f"Drop {'them' if len(changed) > 1 else 'it'}."
            )
        self.recipe()  # the passes check what they take together (SparseLoCo's topk <= chunk_size², DeMo's bins)

    def recipe(self) -> Recipe:
        """The mode's own passes, schedule and layout, before the wrapping features."""
        raise NotImplementedError

    def wrapping(self) -> Wrapping:
        """The wrapping features this config switches on (its fields of those names)."""
        return Wrapping(**{f.name: getattr(self, f.name, None) for f in dataclasses.fields(Wrapping)})

    def refusal(self, surroundings: Surroundings) -> str | None:
        """Why this config's fields do not run in ``surroundings`` beyond what every mode checks (None: they do)."""
        return None

    def for_quorum(self: M, group: int) -> M:
        """This config for one replica group of ``group`` ranks under a quorum (DiLoCo's replica is the group)."""
        return self

    def strategy(self, surroundings: Surroundings = ALONE) -> Strategy:
        """The strategy of this config in ``surroundings``, or a ConfigurationError saying what does not fit."""
        check_fit(self, surroundings)
        group = surroundings.quorum_group
        config = self if group is None else self.for_quorum(group)
        strategy = compose(config.recipe(), config.wrapping())
        if surroundings.tensor_parallel:
            strategy = strategy.beside_tensor_parallel()
        if surroundings.compiled:
            strategy = strategy.compiled()
        if group is None:
            return strategy
        two_level = self.two_levels_under_quorum or (self.mode in ("allreduce", "fused_allreduce") and group > 1)
        vote = strategy.outer is None  # DiLoCo's syncs take their quorum before the step and vote after it
        in_place = self.in_place_under_quorum and not (surroundings.compiled or surroundings.cuda_graph)
        return strategy.under_quorum(vote=vote, wait=surroundings.async_quorum, two_level=two_level, in_place=in_place)

    def to_dict(self) -> dict[str, Any]:
        """``{"mode": name, field: value, ...}``, less the fields the name sets."""
        implied = next(e.implied for e in self.names if e.name == self.mode)
        return {"mode": self.mode} | {k: v for k, v in super().to_dict().items() if k not in implied}

    @classmethod
    def from_dict(cls: type[M], data: Mapping[str, Any]) -> M:
        """A config of this class from :meth:`to_dict`'s form; its ``mode`` (if given) one of the class's names."""
        fields = dict(data)
        name = fields.pop("mode", None)
        if name is not None:
            entry = next((e for e in cls.names if e.name == name), None)
            if entry is None:
                names = ", ".join(e.name for e in cls.names)
                raise ConfigurationError(f"{cls.__name__} is mode {names}; the data names mode {name!r}.")
            for key, value in entry.implied.items():
                if key in fields and fields[key] != value:
                    raise ConfigurationError(
                        f"mode '{name}' is {cls.__name__} with {key}={value!r}; the data also says {key}="
                        f"{fields[key]!r}. Give one of them."
                    )
                fields[key] = value
        return super().from_dict(fields)


# what a mode may not take under a quorum, and why: its wrapping features that spread one update over several steps
_NOT_UNDER_QUORUM = {"accumulation": "spreads one update over several", "freeze": "spreads one update over several"}
# what it may not take beside a tensor-parallel plan, and why
_NOT_BESIDE_TENSOR_PARALLEL = {
    "clipping": "clipping takes the norm of the whole gradient, and each rank holds shards of it",
    "loss_scaling": "a loss scale skips a step on an overflow found in this rank's shards only, so the ranks of "
    "one tensor-parallel group could disagree",
}


def not_under_quorum(name: str, why: str) -> str:
    """Why field ``name`` is refused under a torchft quorum: it ``why`` (a step the quorum could not vote on)."""
    return (
        f"{name} does not run under fault_tolerance yet: a quorum votes on each step, and {name} {why}. Drop it, or "
        "drop fault_tolerance."
    )


def check_fit(config: ModeConfig, surroundings: Surroundings) -> None:
    """A ConfigurationError for a config that does not run in ``surroundings``, saying what does."""
    mode = config.mode
    if surroundings.tensor_parallel:
        if mode not in TENSOR_PARALLEL_MODES:
            raise ConfigurationError(
                f"mode '{mode}' does not run beside a tensor-parallel plan; these do: "
                f"{', '.join(TENSOR_PARALLEL_MODES)}. Each rank there holds shards of the parameters, and the others "
                "need whole tensors (AdaSum's and DimReduce's dot products, compressors' and sparsifiers' per-tensor "
                "norms and top-k) or exchange what TP splits."
            )
        for name, why in _NOT_BESIDE_TENSOR_PARALLEL.items():
            if getattr(config, name, None) is not None:
                raise ConfigurationError(f"{name} does not run beside a tensor-parallel plan: {why}. Leave it out.")
        if surroundings.quorum_group is not None:
            raise ConfigurationError(
                "fault_tolerance= does not run beside a tensor-parallel plan yet: a replica group would have to "
                "heal every rank's shards from the peer of the same tensor-parallel rank. Train without it."
            )
        if surroundings.cuda_graph:
            raise ConfigurationError(
                "cuda_graph=True is not built beside a tensor-parallel plan: its collectives on the 'tp' group are "
                "not checked under capture. Leave it off (compile=True works)."
            )
    if surroundings.quorum_group is not None:
        if mode not in QUORUM_MODES:
            raise ConfigurationError(
                f"fault_tolerance is built for modes {', '.join(QUORUM_MODES)}; mode '{mode}' is not yet. Use one "
                "of those, or drop fault_tolerance (torchrun's elastic restarts still recover every mode)."
            )
        for name, why in _NOT_UNDER_QUORUM.items():
            if getattr(config, name, None) is not None:
                raise ConfigurationError(not_under_quorum(name, why))
    if surroundings.pipeline:
        check_pipeline_fit(config, surroundings)
    refused = config.refusal(surroundings)
    if refused is not None:
        raise ConfigurationError(refused)


def check_pipeline_fit(config: ModeConfig, surroundings: Surroundings) -> None:
    """Beside a pipeline: the modes checked there, uncaptured, with clipping (the stages' norms meet) and no other
    feature (an overflow check, an accumulation or a compressor of one stage's gradients alone would make the
    stages disagree)."""
    if config.mode not in PIPELINE_MODES:
        raise ConfigurationError(
            f"mode '{config.mode}' is not built beside a pipeline yet; these are: {', '.join(PIPELINE_MODES)}."
        )
    features = [
        f.name
        for f in dataclasses.fields(config)
        if "feature" in f.metadata and getattr(config, f.name) and f.name not in PIPELINE_FEATURES
    ]
    if features:
        raise ConfigurationError(
            f"{', '.join(features)} beside a pipeline is not built yet: each stage holds only its own gradients, so "
            "an overflow check, an accumulation or a compressor would see one stage's share. Leave it out."
        )
    if surroundings.cuda_graph:
        raise ConfigurationError("cuda_graph=True is not built beside a pipeline yet; leave it off.")
