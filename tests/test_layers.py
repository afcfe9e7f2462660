"""The package's layers (docs/design.md): each imports only the layers below it, and the public API loads directly."""

import subprocess
import sys
from pathlib import Path

from importlinter.cli import lint_imports

import transpiler

ROOT = Path(__file__).resolve().parents[1]


def test_layers_import_downward_only(monkeypatch):
    """The import-linter contracts in pyproject.toml: no layer imports a layer above it, every module of
    transpiler/ sits in a layer (exhaustive), so a new module has to be placed; inside trace/, the tracer reads
    the optimizer plans and an optimizer's path runs one way (generic plan, then twins and chains)."""
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_the_public_api_is_imported_not_loaded_lazily():
    assert "transpile" in vars(transpiler) and "DistributedStep" in vars(transpiler)
    assert not hasattr(transpiler, "__getattr__")


def test_any_module_can_be_imported_first():
    """A pass module imported before anything else (a user's own pipeline does that) loads the whole package
    through its root without a circular import."""
    code = "import transpiler.passes.adasum, transpiler.graph.program; from transpiler import transpile"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
