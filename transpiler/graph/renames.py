"""Pass options whose names changed, so that every knob has one name in the configs, the passes' specs, the
CLI's ``-O``, the docs and the checkpoints (issue 73). A spec or a checkpoint written with an old name still
reads: :func:`current_option` maps it, with a :class:`~transpiler.errors.RenamedWarning` naming the new one, and
:func:`current_spec` rewrites a whole spec the same way (a snapshot's recorded pipelines)."""

from __future__ import annotations

import re
import warnings

from transpiler.errors import RenamedWarning

# pass name -> {old option name: new option name}
RENAMED: dict[str, dict[str, str]] = {
    "demo-exchange": {
        "decay": "compression_decay",
        "chunk": "chunk_size",
        "bins": "quantization_bins",
        "sigmas": "quantization_range",
    },
    "diloco-outer-step": {
        "alpha": "fragment_update_alpha",
        "exchange": "exchange_dtype",
        "offload": "offload_global",
        "chunk": "chunk_size",
        "bins": "quantization_bins",
        "sigmas": "quantization_range",
        "error_lr": "outer_lr",
    },
    "fuse-allreduce": {"compress": "wire_dtype"},
    "local-sgd-average": {"compress": "wire_dtype"},
}


def current_option(pass_name: str, key: str, *, warn: bool = True) -> str:
    """Option ``key`` of pass ``pass_name`` (snake_case) by its current name; an old name warns once per call."""
    new = RENAMED.get(pass_name, {}).get(key)
    if new is None:
        return key
    if warn:
        warnings.warn(
            f"option '{key}' of pass '{pass_name}' is now '{new}': write {pass_name}{{{new.replace('_', '-')}=...}}.",
            RenamedWarning,
            stacklevel=3,
        )
    return new


_OPTION = re.compile(r"([{,]\s*)([a-z0-9-]+)(\s*=)")


def current_spec(spec: str) -> str:
    """A pipeline spec with every renamed option written by its new name (no warning: the caller says why)."""

    def item(match: re.Match) -> str:
        name, body = match.group(1), match.group(2)
        if body is None or name not in RENAMED:
            return match.group(0)

        def key(option: re.Match) -> str:
            old = option.group(2).replace("-", "_")
            return option.group(1) + current_option(name, old, warn=False).replace("_", "-") + option.group(3)

        return name + "{" + _OPTION.sub(key, "{" + body)[1:] + "}"

    return re.sub(r"([a-z0-9-]+)(?:\{([^{}]*)\})?", item, spec)
