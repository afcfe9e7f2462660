"""Typed options, parsed one way from Python, from a pipeline spec and from the CLI.

An option is declared once, with its type, range and help, where it belongs:
as a field of a pass (``option(25.0, minimum=0)``) or of a mode. A value given
as text (a spec, ``-O key=value``, or a string from Python) is parsed by the
type's text rules; any other value must already be of that type. A value of
the wrong type, out of range, not finite, or not among the choices is a
:class:`ConfigurationError` that names the option, what it accepts and what it
got. Nothing is truncated or coerced silently: ``2.7`` is not an int and
``"false"`` is false.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from transpiler.errors import ConfigurationError

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class OptionSpec:
    """One option: its type (bool, int, float or str), default, range or choices, and help."""

    kind: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    help: str = ""
    words: tuple[tuple[str, Any], ...] = ()  # named values besides numbers: (("dynamic", "dynamic"), ("inf", inf))

    def accepts(self) -> str:
        """What the option accepts, in words ('an int >= 1')."""
        named = " or " + " or ".join(repr(w) for w, _ in self.words) if self.words else ""
        return self._accepts() + named

    def _accepts(self) -> str:
        if self.kind is bool:
            return "a bool (true or false)"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        bounds = []
        if self.minimum is not None:
            bounds.append(f">= {self.minimum:g}")
        if self.maximum is not None:
            bounds.append(f"<= {self.maximum:g}")
        noun = "an int" if self.kind is int else "a finite float"
        return noun + (" " + " and ".join(bounds) if bounds else "")

    def parse(self, name: str, value: Any, owner: str) -> Any:
        """The value as this option's type, or a ConfigurationError that says what was wrong."""

        def bad(why: str = "") -> ConfigurationError:
            return ConfigurationError(
                f"option '{name}' of {owner} wants {self.accepts()}; got {value!r}" + (f" ({why})" if why else "") + "."
            )

        for word, meaning in self.words:
            if (isinstance(value, str) and value.strip().lower() == word) or _same(value, meaning):
                return meaning
        parsed = self._from_text(value, bad) if isinstance(value, str) else self._from_value(value, bad)
        if self.kind is not str and self.kind is not bool:
            if not math.isfinite(parsed):
                raise bad("not finite")
            if self.minimum is not None and parsed < self.minimum:
                raise bad("too small")
            if self.maximum is not None and parsed > self.maximum:
                raise bad("too large")
        if self.choices and parsed not in self.choices:
            raise bad()
        return parsed

    def _from_text(self, text: str, bad) -> Any:
        raw = text.strip()
        if self.kind is str:
            return raw
        if self.kind is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise bad()
        try:
            return self.kind(raw)  # int("2.7") fails: no silent truncation
        except ValueError:
            raise bad() from None

    def _from_value(self, value: Any, bad) -> Any:
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            raise bad(f"a {type(value).__name__}")
        if isinstance(value, bool) or self.kind is str:
            raise bad(f"a {type(value).__name__}")
        if self.kind is int and isinstance(value, numbers.Integral):
            return int(value)
        if self.kind is float and isinstance(value, numbers.Real):
            return float(value)
        raise bad(f"a {type(value).__name__}")


def _same(value: Any, meaning: Any) -> bool:
    """``value`` is the named value itself (``math.inf`` given for ``'inf'``), not merely equal to it (1 == True)."""
    return type(value) is type(meaning) and value == meaning


def option(
    default: Any,
    *,
    minimum=None,
    maximum=None,
    choices: tuple[str, ...] = (),
    help: str = "",
    kind: type | None = None,
    words: tuple[tuple[str, Any], ...] = (),
) -> Any:
    """A dataclass field that is a typed option (for passes: ``bucket_cap_mb: float = option(25.0, minimum=0)``)."""
    spec = OptionSpec(kind or type(default), default, minimum, maximum, tuple(choices), help, tuple(words))
    return dataclasses.field(default=default, metadata={"option": spec})


def field_options(cls: type) -> dict[str, OptionSpec]:
    """The typed options of a dataclass (a pass), by field name."""
    out = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("option")
        out[f.name] = spec if spec is not None else OptionSpec(type(f.default), f.default)
    return out


def key_values(items: list[str]) -> dict[str, str]:
    """``["k_steps=4", ...]`` (``-O`` on a command line) as text values; the mode parses each by its type."""
    options = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"option '{item}' needs the form key=value.")
        options[key.strip().replace("-", "_")] = raw
    return options


def parse_options(specs: dict[str, OptionSpec], values: dict[str, Any], owner: str) -> dict[str, Any]:
    """Check names and parse every value; unknown names are an error that lists the known ones."""
    unknown = sorted(set(values) - set(specs))
    if unknown:
        known = ", ".join(specs) or "none"
        raise ConfigurationError(f"{owner} takes no option(s) {unknown}; its options: {known}.")
    return {name: specs[name].parse(name, value, owner) for name, value in values.items()}
