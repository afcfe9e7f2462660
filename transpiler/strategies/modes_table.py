"""The modes as ``transpiler modes`` lists them and as the README's table shows them, both made from the config
classes: each name, its config, every option with its default, and the pipeline of each program variant that the
defaults build."""

from __future__ import annotations

import dataclasses

from transpiler.graph.pipeline import format_value

from .mode_config import ModeConfig, ModeName
from .modes import MODES

_MISSING = dataclasses.MISSING


def options_of(config: ModeConfig, entry: ModeName) -> list[str]:
    """``name=default`` for each field of a mode's config that its name leaves open (a feature's field: its class,
    off by default)."""
    out = []
    for f in dataclasses.fields(config):
        if f.name in entry.implied or f.name in entry.without:
            continue
        kind = f.metadata.get("feature")
        if kind is not None:
            out.append(f"{f.name}={kind.__name__}(...)")
        elif f.default is _MISSING:
            out.append(f"{f.name} (required)")
        else:
            out.append(f"{f.name}={format_value(getattr(config, f.name))}")
    return out


def pipelines(config: ModeConfig) -> dict[str, str]:
    """Each program variant's pipeline spec under the config's defaults."""
    return {variant: spec or "(no passes)" for variant, spec in config.strategy().specs().items()}


def _default(name: str) -> ModeConfig:
    """Mode ``name``'s config with its defaults."""
    return MODES[name][0].from_dict({"mode": name})


def listing() -> str:
    """What ``transpiler modes`` prints."""
    width = max(map(len, MODES))
    lines = []
    for name, (_, entry) in MODES.items():
        config = _default(name)
        lines.append(f"{name:{width}s}  {config!r}: {entry.summary}")
        lines.append(f"{'':{width}s}    options: {', '.join(options_of(config, entry)) or 'none'}")
        for variant, spec in pipelines(config).items():
            label = "" if variant == "step" else f"{variant}: "
            lines.append(f"{'':{width}s}    = {label}{spec}")
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The README's table of modes (``transpiler modes --markdown``; tests/test_readme.py compares the two)."""
    rows = ["| mode | config | options (defaults) | passes |", "|---|---|---|---|"]
    for name, (_, entry) in MODES.items():
        config = _default(name)
        options = ", ".join(f"`{o}`" for o in options_of(config, entry)) or "none"
        specs = pipelines(config)
        passes = "<br>".join(f"{v}: `{s}`" if len(specs) > 1 else f"`{s}`" for v, s in specs.items())
        rows.append(f"| `{name}` | `{config!r}` | {options} | {passes} |")
    return "\n".join(rows) + "\n"
