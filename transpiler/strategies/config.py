"""The configs of the modes and their features build on the graph layer's :class:`Config`, with one more kind of
field: :func:`knob`, the option of the same name of the pass that reads it (``knob(25.0, of="fuse-allreduce")``).
Its type, bounds and help are the pass's, read from the pass when a config is first made, so a knob is typed once
and named once: in the config, in the pass's spec, on the CLI (``-O bucket_cap_mb=4``), in JSON and in the docs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from passes.registry import PASSES
from transpiler.graph.config import Config, feature, field_spec, own
from transpiler.graph.options import OptionSpec, field_options

__all__ = ["Config", "PassKnobs", "feature", "field_spec", "knob", "own"]
_MISSING = dataclasses.MISSING


def knob(default: Any = _MISSING, *, of: str, **changes: Any) -> Any:
    """A field that is option ``<field name>`` of pass ``of``, typed there; ``changes`` narrow it here (choices,
    bounds, words). A default of None stands for a value the config works out from its other fields."""
    return dataclasses.field(default=default, metadata={"pass": of, "changes": changes})


@dataclass(frozen=True, kw_only=True, repr=False)
class PassKnobs(Config):
    """A config whose fields may be :func:`knob` s."""

    @classmethod
    def option_spec(cls, name: str, metadata: Mapping[str, Any]) -> OptionSpec | None:
        if "pass" not in metadata:
            return super().option_spec(name, metadata)
        spec = field_options(PASSES[metadata["pass"]])[name]
        return dataclasses.replace(spec, **metadata["changes"]) if metadata["changes"] else spec
