"""Pass base class, text specs, and the pipeline that verifies between passes.

A pass is a frozen dataclass with a kebab-case ``name``; its fields are its
options, written in a spec as ``name{field-name=value,...}``, e.g.
``scale-loss-grad,fuse-allreduce{bucket-cap-mb=25}``. ``run`` rewrites a
:class:`StepProgram` and returns whether it changed the graph.

A pass also states the facts about the graph it ``requires``, those it ``ensures`` and those it
``invalidates``, as torch.fx's pass infrastructure has ``requires``/``ensures`` hooks. A traced program starts
with the facts of :data:`TRACED` and a pipeline must end with those of :data:`COMPLETE`; :func:`check_order`
walks a pipeline before anything runs, and a pass whose fact an earlier pass took away, or that only a later
pass provides, is a :class:`PipelineSpecError` that names both passes.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from transpiler.errors import ConfigurationError, PipelineSpecError, TranspilerError, VerificationError

from .options import field_options, option, parse_options
from .program import StepProgram
from .renames import current_option


class Fact(str, enum.Enum):
    """A fact about a step program that a pass may require, ensure or invalidate (the value says it in words)."""

    FUNCTIONAL = "a functional graph (the update not yet made in place)"
    UNREDUCED = "the backward's gradients, not yet reduced across ranks"
    UNACCUMULATED = "gradients not yet accumulated over micro-steps"
    UNTOUCHED = "gradients as reduced, not yet unscaled or clipped"
    PER_PARAMETER = "an optimizer update per parameter (not yet grouped into multi-tensor ops)"
    UNFLATTENED = "parameters, gradients and updates one by one (not yet in flat buffers)"
    UPDATING = "an optimizer update that reads the gradients (not an accumulation micro-step)"
    UPDATED_LOCALLY = "each parameter's new value is its own update's (not yet averaged with other ranks')"
    WHOLE_PARAMETERS = "every parameter's new value whole, or held as this rank's slice by shard-params"
    REDUCED = "gradients reduced across ranks"
    STATE_SHARDED = "the optimizer state sharded over the ranks"

    __str__ = str.__str__


TRACED = frozenset(
    {
        Fact.FUNCTIONAL,
        Fact.UNREDUCED,
        Fact.UNACCUMULATED,
        Fact.UNTOUCHED,
        Fact.PER_PARAMETER,
        Fact.UNFLATTENED,
        Fact.UPDATING,
        Fact.UPDATED_LOCALLY,
        Fact.WHOLE_PARAMETERS,
    }
)
COMPLETE = frozenset({Fact.WHOLE_PARAMETERS})  # what must hold when a pipeline ends


@dataclass(frozen=True)
class Pass:
    """Base of every rewrite pass (see the module docstring)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # the facts it needs before it runs, those it makes true and those it makes false (options may change them)
    requires: ClassVar[frozenset[Fact]] = frozenset({Fact.FUNCTIONAL})
    ensures: ClassVar[frozenset[Fact]] = frozenset()
    invalidates: ClassVar[frozenset[Fact]] = frozenset()
    reduces_gradients: ClassVar[bool] = False  # after it, every gradient must be reduced exactly once
    shards_state: ClassVar[bool] = False  # it cuts the optimizer state into this rank's slices (program.shards)
    shards_params: ClassVar[bool] = False  # the model holds this rank's slices of its parameters (ZeRO-3)
    axis: str = option(
        "world",
        help="the ranks it works across: 'world' (all), or an axis of a 2-D layout ('replica', 'across')",
    )

    def run(self, program: StepProgram) -> bool:
        raise NotImplementedError

    def for_inductor(self) -> Pass:
        """This pass as it should run in a program ``torch.compile`` takes (``Strategy.compiled``): itself, unless
        a pass has a form Inductor compiles better."""
        return self

    def __post_init__(self) -> None:
        """Options are parsed strictly, whether the pass is built from Python or from a spec."""
        for name, spec in field_options(type(self)).items():
            object.__setattr__(self, name, spec.parse(name, getattr(self, name), f"pass '{self.name}'"))

    def spec(self) -> str:
        opts = [
            f"{f.name.replace('_', '-')}={format_value(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


@dataclass(frozen=True)
class ReducingPass(Pass):
    """Base of a pass that reduces the backward's gradients across ranks, each once (the verifiers hold it to
    that): it comes before anything unscales, clips or reduces them again."""

    reduces_gradients = True
    requires = frozenset({Fact.FUNCTIONAL, Fact.UNREDUCED, Fact.UNTOUCHED, Fact.UNFLATTENED, Fact.UPDATING})
    ensures = frozenset({Fact.REDUCED})
    invalidates = frozenset({Fact.UNREDUCED})


def format_value(value: object) -> str:
    """An option value as a spec writes it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


_ITEM = re.compile(r"\s*([a-z0-9-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_spec(spec: str, registry: dict[str, type[Pass]]) -> list[Pass]:
    """Parse ``a,b{opt=1}`` into pass instances, with errors that name the bad part."""
    passes: list[Pass] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        m = _ITEM.match(spec, pos)
        if not m or m.end() == pos:
            raise PipelineSpecError(f"cannot parse pipeline spec at character {pos}: '{spec[pos:]}'.")
        name, body = m.group(1), m.group(2)
        if name not in registry:
            raise PipelineSpecError(f"unknown pass '{name}'; known passes: {', '.join(sorted(registry))}.")
        raw: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in (body or "").split(","))):
            if "=" not in item:
                raise PipelineSpecError(f"option '{item}' of pass '{name}' needs the form key=value.")
            key, value = (s.strip() for s in item.split("=", 1))
            raw[current_option(name, key.replace("-", "_")).replace("_", "-")] = value
        cls = registry[name]
        specs = {f.replace("_", "-"): spec for f, spec in field_options(cls).items()}
        try:
            kwargs = {k.replace("-", "_"): v for k, v in parse_options(specs, raw, f"pass '{name}'").items()}
        except ConfigurationError as exc:
            raise PipelineSpecError(str(exc)) from None
        passes.append(registry[name](**kwargs))
        pos = m.end()
    if not passes:
        raise PipelineSpecError("the pipeline spec is empty.")
    return passes


def check_order(passes: Sequence[Pass]) -> None:
    """Every pass finds the facts it requires: held since tracing or ensured by an earlier pass, and taken away by
    none in between; and the pipeline ends with the facts of a complete step. Otherwise a PipelineSpecError names
    the pass and the one to move, or to add."""
    held = set(TRACED)
    for i, p in enumerate(passes):
        for fact in sorted(p.requires - held):
            taker = next((q for q in reversed(passes[:i]) if fact in q.invalidates), None)
            giver = next((q for q in passes[i + 1 :] if fact in q.ensures), None)
            if taker is not None:
                how = f"'{taker.name}' before it takes that away: put {p.name} before {taker.name}"
            elif giver is not None:
                how = f"'{giver.name}' ensures it, but later: put {giver.name} before {p.name}"
            else:
                how = "and no pass before it ensures it: add one that does"
            raise PipelineSpecError(f"pass '{p.name}' requires {fact.value}; {how}.")
        held = (held - p.invalidates) | p.ensures
    for fact in sorted(COMPLETE - held):
        taker = next(q for q in reversed(passes) if fact in q.invalidates)
        raise PipelineSpecError(
            f"a step needs {fact.value} when its pipeline ends; '{taker.name}' takes that away and no pass after it "
            "gives it back: add one that does (after shard-optimizer: gather-params, or shard-params)."
        )


Verifier = Callable[[StepProgram, bool], None]


@dataclass
class PassRecord:
    name: str
    modified: bool
    seconds: float


@dataclass
class Pipeline:
    """An ordered list of passes, verified after each one unless ``verify`` is off."""

    passes: list[Pass]
    verifiers: list[Verifier] = field(default_factory=list)
    verify: bool = True
    on_pass: Callable[[str, StepProgram], None] | None = None
    keep_history: bool = True  # the code and op counts after each pass (a program only checked, never shown: off)

    def __post_init__(self) -> None:
        check_order(self.passes)

    def spec(self) -> str:
        return ",".join(p.spec() for p in self.passes)

    def run(self, program: StepProgram) -> list[PassRecord]:
        records = []
        done: list[str] = []
        final_reduction = any(p.reduces_gradients for p in self.passes) and program.world_size > 1
        for i, p in enumerate(self.passes):
            start = time.perf_counter()
            try:
                with program.on_axis(p.axis):
                    modified = bool(p.run(program))
            except TranspilerError:
                raise
            except Exception as exc:
                raise VerificationError(
                    f"pass '{p.name}' failed: {type(exc).__name__}: {exc}", pass_name=p.name, passes_before=tuple(done)
                ) from exc
            last = i == len(self.passes) - 1
            compiled = last or self.on_pass is not None  # history needs only the code text (snapshot)
            if compiled:
                program.recompile()
            if self.verify:
                self.check(program, p.name, tuple(done), final=last and final_reduction)
            records.append(PassRecord(p.name, modified, time.perf_counter() - start))
            if self.keep_history:
                program.snapshot(p.spec(), program.graph_module.code if compiled else None)
            if self.on_pass is not None:
                self.on_pass(p.spec(), program)
            done.append(p.name)
        return records

    def check(self, program: StepProgram, pass_name: str, before: tuple[str, ...], *, final: bool) -> None:
        try:
            program.graph.lint()
            for verifier in self.verifiers:
                verifier(program, final)
        except VerificationError as exc:
            raise VerificationError(str(exc), pass_name=pass_name, passes_before=before) from exc
        except Exception as exc:  # graph.lint raises RuntimeError
            raise VerificationError(f"{type(exc).__name__}: {exc}", pass_name=pass_name, passes_before=before) from exc
