"""Typed configs: the base of every config (a mode's, a feature's, the execution settings).

A config is a frozen dataclass with keyword-only fields. A field is declared with :func:`own` (typed here, as a
pass's option is), as a feature's own config (:func:`feature`), or, in a mode's config, as the option of the pass
that reads it (``strategies/config.py``'s ``knob``). A plain field takes any value (a function).

Every value is checked when the config is made, before anything is traced: a bad one is a
:class:`~transpiler.errors.ConfigurationError` naming the field and what it accepts. A config prints as the
expression that makes it (only what differs from the defaults), compares by value, and goes to and from a dict
(:meth:`Config.to_dict`, :meth:`Config.from_dict`) and JSON; text values (a JSON string, a CLI ``-O``) are parsed by
the field's type, as a pass's spec is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from transpiler.errors import ConfigurationError

from .options import OptionSpec

C = TypeVar("C", bound="Config")
_MISSING = dataclasses.MISSING


def own(
    default: Any = _MISSING,
    *,
    kind: type | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] = (),
    help: str = "",
) -> Any:
    """A field only the config has, typed here (``kind``: its type, when it has no default to tell)."""
    given = None if default is _MISSING else default
    spec = OptionSpec(kind or type(given), given, minimum, maximum, tuple(choices), help)
    return dataclasses.field(default=default, metadata={"option": spec})


def feature(kind: type[Config]) -> Any:
    """A field that holds a feature's config (``Accumulation``...), or None: the feature is off."""
    return dataclasses.field(default=None, metadata={"feature": kind})


@functools.cache
def field_spec(cls: type[Config], name: str) -> OptionSpec | None:
    """The option spec of field ``name`` of config class ``cls`` (None: a feature's, or one of any value)."""
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    return cls.option_spec(name, meta)


@dataclass(frozen=True, kw_only=True, repr=False)
class Config:
    """Base of every config (see the module docstring)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked(type(self), f, getattr(self, f.name), owner))
        self.check()

    def check(self) -> None:
        """Rules across fields: a ConfigurationError that names them. Nothing by default."""

    @classmethod
    def option_spec(cls, name: str, metadata: Mapping[str, Any]) -> OptionSpec | None:
        """The spec of a field with this metadata (:func:`field_spec` caches it)."""
        return metadata.get("option")

    def __repr__(self) -> str:
        """The expression that makes this config: its required fields and those that differ from the defaults."""
        fields = dataclasses.fields(self)
        required = {f.name: getattr(self, f.name) for f in fields if f.default is _MISSING}
        plain = type(self)(**required)  # the defaults, as worked out for these required fields
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields
            if f.name in required or getattr(plain, f.name) != getattr(self, f.name)
        ]
        return f"{type(self).__name__}({', '.join(shown)})"

    def to_dict(self) -> dict[str, Any]:
        """Every field by name: a feature as its own dict (or None), a named value (``inf``) by its name."""
        return {f.name: _plain(type(self), f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
        """The config whose fields ``data`` gives (as :meth:`to_dict` writes them; text values parsed by type)."""
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{cls.__name__} is read from a mapping of its fields; got {type(data).__name__}.")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigurationError(
                f"{cls.__name__} has no field(s) {unknown}; its fields: {', '.join(names) or 'none'}."
            )
        try:
            return cls(**data)
        except TypeError as exc:  # a required field left out
            raise ConfigurationError(f"{cls.__name__}: {exc}.") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def _checked(cls: type, f: dataclasses.Field, value: Any, owner: str) -> Any:
    """``value`` of field ``f`` as its type, or a ConfigurationError saying what the field accepts."""
    kind = f.metadata.get("feature")
    if kind is not None:
        if value is None or isinstance(value, kind):
            return value
        if isinstance(value, Mapping):
            return kind.from_dict(value)
        raise ConfigurationError(
            f"field '{f.name}' of {owner} wants a {kind.__name__} or None (off); got {value!r}. Write "
            f"{f.name}={kind.__name__}(...)."
        )
    spec = field_spec(cls, f.name)
    if spec is None or (value is None and f.default is None):
        return value  # a field of no option (a function), or one worked out from the others (check())
    return spec.parse(f.name, value, owner)


def _plain(cls: type, name: str, value: Any) -> Any:
    """A field's value as JSON writes it."""
    if isinstance(value, Config):
        return value.to_dict()
    spec = field_spec(cls, name)
    for word, meaning in spec.words if spec is not None else ():
        if type(value) is type(meaning) and value == meaning:
            return word
    return value
