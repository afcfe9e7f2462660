"""The modes by name (``transpiler modes``): which config each name is, and how a name with its options, a dict or
a JSON file becomes a config. An explicit pipeline of passes is :class:`PassPipeline`, not a mode.

The options of a mode are its config's fields, by the same names everywhere: Python (``ZeRO(stage=3,
bucket_cap_mb=4)``), ``mode_config("zero3", bucket_cap_mb=4)``, the CLI (``-O bucket_cap_mb=4``, a feature's
field as ``-O accumulation.steps=4``) and JSON (``{"mode": "zero3", "bucket_cap_mb": 4}``). The names of
before issue 73 (``accumulate_steps=4``, ``compression_topk=...``) still work, each with a
:class:`~transpiler.errors.RenamedWarning` naming its new spelling (``legacy.py``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passes.registry import PASSES
from transpiler.errors import ConfigurationError, RenamedWarning
from transpiler.graph.pipeline import parse_spec

from .config import own
from .data_parallel import AdaSum, AllGather, DataParallel, DeMo, DimReduce, NoSync, ZeRO
from .diloco import DiLoCo, SparseLoCo, StreamingDiLoCo
from .legacy import nested, renamed_options
from .local_updates import LocalSGD, PartialSync
from .mode_config import ModeConfig, ModeName
from .strategy import Recipe


@dataclass(frozen=True, kw_only=True, repr=False)
class PassPipeline(ModeConfig):
    """An explicit pipeline of passes as a text spec (``"scale-loss-grad,fuse-allreduce{bucket-cap-mb=4}"``;
    ``transpiler passes`` lists them): exactly these passes, no startup broadcast, no feature woven in."""

    spec: str = own(kind=str, help="passes by name, each with its options in braces, separated by commas")

    def check(self) -> None:
        parse_spec(self.spec, PASSES)  # a PipelineSpecError names the bad part now

    @property
    def mode(self) -> str:
        return self.spec

    def recipe(self) -> Recipe:
        return Recipe({"step": parse_spec(self.spec, PASSES)})

    def to_dict(self) -> dict[str, Any]:
        return {"pipeline": self.spec}


# every mode's config, in the order ``transpiler modes`` lists their names
CONFIGS: tuple[type[ModeConfig], ...] = (
    NoSync,
    DataParallel,
    LocalSGD,
    DiLoCo,
    StreamingDiLoCo,
    SparseLoCo,
    DeMo,
    AdaSum,
    AllGather,
    DimReduce,
    ZeRO,
    PartialSync,
)
MODES: dict[str, tuple[type[ModeConfig], ModeName]] = {
    entry.name: (cls, entry) for cls in CONFIGS for entry in cls.names
}


def mode_config(mode: str, /, **options: Any) -> ModeConfig:
    """The config of mode ``mode`` (a name of ``transpiler modes``) with ``options``: its fields by name, a
    feature's as a config, a dict or dotted (``**{"accumulation.steps": 4}``), values typed or as text."""
    config, renamed = config_and_renames(mode, options)
    if renamed:
        warnings.warn(f"{'; '.join(renamed)}: write {config!r}.", RenamedWarning, stacklevel=2)
    return config


def config_and_renames(mode: str, options: Mapping[str, Any]) -> tuple[ModeConfig, list[str]]:
    """:func:`mode_config`'s config, and each old option name it was given, said as old -> new (no warning)."""
    if not isinstance(mode, str):
        raise ConfigurationError(f"a mode is named by a str ('transpiler modes'); got {type(mode).__name__}.")
    if mode not in MODES:
        hint = " (an explicit pipeline of passes is PassPipeline(spec))" if any(c in mode for c in ",{") else ""
        raise ConfigurationError(f"unknown mode '{mode}'{hint}. Modes: {', '.join(MODES)}.")
    cls, _ = MODES[mode]
    fields, renamed = renamed_options(mode, dict(options))
    data = nested(fields)
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)} - {"mode"})
    if unknown:
        raise ConfigurationError(_unknown(mode, cls, unknown))
    return cls.from_dict({"mode": mode, **data}), renamed


def config_from_dict(data: Mapping[str, Any]) -> ModeConfig:
    """The config a dict describes: ``{"mode": NAME, field: value, ...}`` (:meth:`ModeConfig.to_dict`), or
    ``{"pipeline": SPEC}``."""
    if not isinstance(data, Mapping):
        raise ConfigurationError(f"a config is read from a mapping; got {type(data).__name__}.")
    if "pipeline" in data:
        if set(data) != {"pipeline"}:
            raise ConfigurationError(f"a pipeline config holds only 'pipeline'; got {sorted(data)}.")
        return PassPipeline(spec=data["pipeline"])
    if "mode" not in data:
        raise ConfigurationError(
            f'a config names its mode: {{"mode": NAME, ...}} with NAME one of {", ".join(MODES)}; or '
            f'{{"pipeline": SPEC}}. Got the keys {sorted(data)}.'
        )
    mode = data["mode"]
    return mode_config(mode, **{k: v for k, v in data.items() if k != "mode"})


def load_config(path: str | Path, /, **options: Any) -> ModeConfig:
    """The config in the JSON file ``path`` (as :meth:`ModeConfig.to_json` writes it), with ``options`` on top (as
    :func:`mode_config` takes them: a CLI's ``-O``)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigurationError(f"cannot read the config file {path}: {exc.strerror}.") from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"the config file {path} is not JSON: {exc}.") from None
    loaded = config_from_dict(data)
    return config_from_dict({**loaded.to_dict(), **options}) if options else loaded


def as_config(value: ModeConfig | str) -> ModeConfig:
    """What ``transpile()`` takes as its config: a config, or a mode's name (its defaults)."""
    if isinstance(value, ModeConfig):
        return value
    if is_pipeline_spec(value):
        warnings.warn(
            f"a pipeline spec as the mode is deprecated: write PassPipeline(spec={value!r}).",
            RenamedWarning,
            stacklevel=3,
        )
        return PassPipeline(spec=value)
    if isinstance(value, str):
        return mode_config(value)
    raise ConfigurationError(
        f"the config is a mode's config (ZeRO(stage=3), DataParallel()...) or a mode's name; got "
        f"{type(value).__name__}."
    )


def is_pipeline_spec(value: object) -> bool:
    """Whether ``value`` is a pipeline spec (passes by name) rather than a mode's name."""
    return isinstance(value, str) and value not in MODES and (any(c in value for c in ",{") or value in PASSES)


def _unknown(mode: str, cls: type, names: list[str]) -> str:
    where = []
    for name in names:
        takers = [m for m, (c, e) in MODES.items() if name in {f.name for f in dataclasses.fields(c)} - {*e.without}]
        where.append(f"'{name}' works with {', '.join(takers)}" if takers else f"'{name}' is no field of any mode")
    known = ", ".join(f.name for f in dataclasses.fields(cls)) or "none"
    return (
        f"mode '{mode}' takes no option(s) {names} ({'; '.join(where)}; see docs/strategies/composition.md). "
        f"Its config {cls.__name__} has: {known}."
    )
