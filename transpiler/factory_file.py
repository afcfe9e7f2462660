"""The CLI's FILE.py:NAME arguments: a factory of (model, optimizer, loss_fn, batch), or any callable (``transpiler
plan --tp-plan``); every failure a FactoryError saying what was wrong."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import FactoryError


def load_factory(spec: str) -> tuple:
    """Import FILE.py:FACTORY and call it; any failure becomes a FactoryError with the cause."""
    factory, path, name = load_callable(spec)
    try:
        made = factory()
    except BaseException as exc:
        raise FactoryError(f"{name}() in {path} failed: {_describe(exc)}") from exc
    if not isinstance(made, tuple) or len(made) != 4:
        raise FactoryError(
            f"{name}() must return (model, optimizer, loss_fn, example_batch); got {type(made).__name__}."
        )
    return made


def load_callable(spec: str) -> tuple[Callable, Path, str]:
    """Import FILE.py:NAME: the callable, its file and its name; a FactoryError says what was wrong."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise FactoryError(f"expected FILE.py:FACTORY, got '{spec}'.")
    path = Path(path_text)
    if not path.is_file():
        raise FactoryError(f"no such file: {path}.")
    if path.suffix != ".py":
        raise FactoryError(f"FACTORY must be in a Python file ending in .py; got {path}.")
    module_name = f"_transpiler_factory_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: never a silent exit
        raise FactoryError(f"importing {path} failed: {_describe(exc)}") from exc
    found = getattr(module, name, None)
    if not callable(found):
        raise FactoryError(f"{path} has no callable '{name}'.")
    return found, path, name


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r}); a FACTORY must return (model, optimizer, loss_fn, batch)"
    return f"{type(exc).__name__}: {exc}"
