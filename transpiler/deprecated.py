"""The keywords ``transpile()`` took before issue 73, as sugar for the typed groups that replaced them: ``mode=`` and
the mode's options (``transpile(..., mode="zero3", bucket_cap_mb=4)``) for the mode's config, the execution flags
for :class:`Execution`, ``world_size``/``rank`` for :class:`StaticWorld`. They build the same programs; each call
warns once (:class:`~transpiler.errors.RenamedWarning`) with the call written anew (docs/migrating.md)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from transpiler.runtime.execution import Execution
from transpiler.runtime.process_group import StaticWorld
from transpiler.strategies.mode_config import ModeConfig
from transpiler.strategies.modes import as_config, config_and_renames, is_pipeline_spec

from .errors import ConfigurationError, RenamedWarning

EXECUTION = frozenset(f.name for f in dataclasses.fields(Execution))
WORLD = ("world_size", "rank")


def keywords_of_before(
    config: ModeConfig | str, execution: Execution | None, mesh: Any, given: dict[str, Any]
) -> tuple[ModeConfig | str, Execution, Any]:
    """The config, execution settings and mesh that ``given`` (the old keywords) stand for, with one warning."""
    if not given:
        return config, execution if execution is not None else Execution(), mesh
    names = sorted(given)
    given = dict(given)
    if "mode" in given:
        config = given.pop("mode")
    settings = {k: given.pop(k) for k in list(given) if k in EXECUTION}
    world = {k: given.pop(k) for k in list(given) if k in WORLD}
    new = _config_with(config, given) if given else as_config(config)
    parts = [repr(new)]
    if settings:
        if execution is not None:
            raise ConfigurationError(f"give the execution settings {sorted(settings)} in execution=, not beside it.")
        execution = Execution(**settings)
        parts.append(f"execution={execution!r}")
    if world:
        if mesh is not None:
            raise ConfigurationError(f"give {sorted(world)} as mesh=StaticWorld(...), not beside mesh=.")
        mesh = StaticWorld(size=world.get("world_size") or 1, rank=world.get("rank") or 0)
        parts.append(f"mesh={mesh!r}")
    warnings.warn(
        f"transpile()'s keywords {names} are deprecated: write transpile(model, optimizer, {', '.join(parts)}, ...) "
        "(docs/migrating.md).",
        RenamedWarning,
        stacklevel=3,
    )
    return new, execution if execution is not None else Execution(), mesh


def _config_with(config: ModeConfig | str, options: dict[str, Any]) -> ModeConfig:
    """A mode's name with its options, as its config."""
    if isinstance(config, ModeConfig):
        raise ConfigurationError(
            f"options {sorted(options)} go in the config: {type(config).__name__}(..., "
            f"{', '.join(f'{k}=...' for k in options)})."
        )
    if is_pipeline_spec(config):
        raise ConfigurationError(
            f"options {sorted(options)} only apply to named modes; put pass options in the spec, "
            "e.g. PassPipeline(spec='fuse-allreduce{bucket-cap-mb=4}')."
        )
    made, _ = config_and_renames(config, options)
    return made
