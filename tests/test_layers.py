"""The package's layers (docs/design.md#layers): the design card's top level (``transpiler/`` and ``passes/``), each
layer importing only the layers below it, any module importable first, and a wheel that carries both packages."""

import ast
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

import passes
import transpiler
from transpiler import DataParallel, LossScaling, transpile

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transpiler", "passes")


def project_modules() -> list[str]:
    """Every module of both packages, by dotted name, from the files on disk (a new module is covered)."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.quick
def test_the_top_level_is_the_design_cards():
    """``passes/`` beside ``transpiler/``: one module per pass, each in the registry; transpiler/ holds the rest."""
    assert (ROOT / "passes" / "__init__.py").is_file() and not (ROOT / "transpiler" / "passes").exists()
    assert sorted(p.name for p in (ROOT / "transpiler").iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "graph",
        "planner",
        "runtime",
        "strategies",
        "trace",
    ]
    modules_of_passes = {f"passes.{cls.__module__.rpartition('.')[2]}" for cls in passes.PASSES.values()}
    assert len(modules_of_passes) == len(passes.PASSES), "one pass per module"
    assert all(cls.name == name for name, cls in passes.PASSES.items()), "each listed under its own name"


@pytest.mark.quick
def test_layers_import_downward_only(monkeypatch):
    """The import-linter contracts in pyproject.toml hold: the stack (cli, api, runtime, strategies, passes, trace,
    graph, errors) imports downward only, passes never import tracing, and every module of transpiler/ and of
    passes/ is placed in a layer (exhaustive)."""
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


BREAKS = {
    # a helper of the passes reaching up into the strategies
    "upward": (
        {"passes/gradient_flow.py": "import transpiler.strategies.modes\n"},
        [
            "passes is not allowed to import transpiler.strategies: "
            "- passes.gradient_flow -> transpiler.strategies.modes"
        ],
    ),
    # below the passes in the stack, yet out of bounds: a pass sees only the program
    "tracing": (
        {"passes/gradient_flow.py": "import transpiler.trace.tracer\n"},
        ["passes is not allowed to import transpiler.trace: - passes.gradient_flow -> transpiler.trace.tracer"],
    ),
    # new modules that nobody placed in a layer
    "unplaced": (
        {"transpiler/stray.py": "", "passes/stray_pass.py": ""},
        ["transpiler.stray", "passes.stray_pass"],
    ),
}


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_the_contracts_fail_on_a_broken_tree(tmp_path, kind):
    """A copy of the tree with one kind of break: lint-imports fails and names the module that broke it."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    additions, expected = BREAKS[kind]
    for relative, text in additions.items():
        with open(tmp_path / relative, "a") as f:
            f.write(text)
    code = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True, no_logo=True))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    report = " ".join(done.stdout.split())  # the report wraps long lines
    for phrase in expected:
        assert phrase in report, report


@pytest.mark.quick
def test_the_public_api_is_imported_and_every_pass_is_named_by_the_package():
    """``transpiler``'s API is imported, not loaded lazily; ``passes`` gives each pass by its class's name through
    the registry (so importing the package loads none), and lists them all."""
    assert "transpile" in vars(transpiler) and "DistributedStep" in vars(transpiler)
    assert not hasattr(transpiler, "__getattr__")
    assert "PASSES" in vars(passes)
    named = {cls.__name__: cls for cls in passes.PASSES.values()}
    assert set(named) <= set(dir(passes)) and set(named) <= set(passes.__all__)
    assert all(getattr(passes, name) is cls for name, cls in named.items())
    with pytest.raises(AttributeError, match="no attribute 'NoSuchPass'"):
        passes.NoSuchPass  # noqa: B018


def test_the_registry_loads_a_pass_when_it_is_first_named():
    """``import passes`` and ``import transpiler`` load no pass module (so neither waits on the other while it
    loads); looking a pass up loads its module, and only the modules that one imports."""
    code = textwrap.dedent(
        """
        import sys
        loaded = lambda: sorted(m for m in sys.modules if m.startswith("passes."))
        import passes
        assert loaded() == ["passes.registry"], loaded()
        import transpiler
        assert loaded() == ["passes.registry"], loaded()
        cls = passes.PASSES["scale-loss-grad"]
        assert cls.__module__ == "passes.scale_loss_grad" and "passes.fuse_allreduce" not in loaded(), loaded()
        assert passes.PASSES["scale-loss-grad"] is cls and "fuse-allreduce" in passes.PASSES
        assert "passes.fuse_allreduce" not in loaded(), loaded()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_one_step_enters_the_run_loop_module_twice():
    """Following a batch through a step, traced first or cached: ``DistributedStep.__call__`` and the run loop it
    wraps are the only frames of ``runtime/distributed_step.py``; every job is another module's."""
    import torch
    from torch import nn

    from transpiler.runtime import distributed_step

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = transpile(model, optimizer, DataParallel(loss_scaling=LossScaling()), loss_fn=nn.CrossEntropyLoss())
    batch = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    entered: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename == distributed_step.__file__:
            entered.append(frame.f_code.co_name)

    for _ in range(2):  # the first step traces, the second finds its programs cached
        sys.setprofile(profile)
        try:
            step(*batch)
        finally:
            sys.setprofile(None)
        assert entered == ["__call__", "_step"]
        entered.clear()


# Imports inside a function, of the project's own modules, with the reason each is deferred. None dodges a cycle.
DEFERRED_IMPORTS = {
    ("transpiler.runtime.dcp_checkpoint", "transpiler.runtime.sharded_checkpoint"): (
        "torch.distributed.checkpoint is loaded when a DCP checkpoint is written or read, not at start-up"
    ),
    ("transpiler.runtime.dcp_checkpoint", "transpiler.runtime.replica_checkpoint"): (
        "the same, for DiLoCo's checkpoints (it imports sharded_checkpoint)"
    ),
}


@pytest.mark.quick
def test_no_import_inside_a_function_dodges_a_cycle():
    found = set()
    for name in project_modules():
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                    module = ".".join(filter(None, (base, node.module)))
                    targets = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                found |= {(name, t) for t in targets if t.split(".")[0] in PACKAGES}
    assert found == set(DEFERRED_IMPORTS)


FIRST_IMPORT_DRIVER = textwrap.dedent(
    """
    import os, sys, traceback
    # What the project imports from outside, loaded once; each statement then runs in a forked child that has
    # none of the project's modules loaded: to the import system, a fresh interpreter.
    import torch, torch._dynamo, torch.distributed, torch.fx, networkx, pydot
    PACKAGES = ("transpiler", "passes")
    assert not any(m.split(".")[0] in PACKAGES for m in sys.modules)

    def child(statement, report=None):
        try:
            exec(statement, {})
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        if report is not None:  # the project's modules the statement loaded
            os.write(report, " ".join(m for m in sys.modules if m.split(".")[0] in PACKAGES).encode())
        os._exit(0)

    def loaded_by(statement):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            child(statement, write)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            names = pipe.read().decode().split()
        return os.waitpid(pid, 0)[1], names

    # "import transpiler.graph.edit" first runs transpiler/__init__.py, as "import transpiler" does; when that has
    # loaded the module, nothing is left for the statement to do: it is that child again, and not run twice.
    failed, covered = [], set()
    for package in PACKAGES:
        status, names = loaded_by(f"import {package}")
        if status:
            failed.append(f"import {package}")
        else:
            covered |= {f"import {name}" for name in names if name != package}
    running = {}

    def reap():
        pid, status = os.wait()
        statement = running.pop(pid)
        if status:
            failed.append(statement)

    for statement in [s for s in sys.argv[1:] if s not in covered and s[len("import "):] not in PACKAGES]:
        if len(running) == os.cpu_count():  # as many children at a time as there are cores
            reap()
        pid = os.fork()
        if pid == 0:
            child(statement)
        running[pid] = statement
    while running:
        reap()
    print("COVERED:", len(covered & set(sys.argv[1:])))
    print("FAILED:", failed)
    sys.exit(1 if failed else 0)
    """
)


def test_any_module_can_be_imported_first():
    """Each statement as the first import of the project, in an interpreter that has loaded none of it: the
    card's ``import passes``, every module of ``passes/`` and of ``transpiler/``, and the public API. A module
    that ``import transpiler`` (or ``import passes``) loads is imported first exactly as that package is, so it
    is covered by that package's child (most of ``transpiler/``)."""
    statements = [
        "import passes",
        "from passes import PASSES, FuseAllReduce",
        "import transpiler",
        "from transpiler import DataParallel, LossScaling, transpile",
        *(f"import {name}" for name in project_modules()),
    ]
    assert "import passes.fuse_allreduce" in statements and "import transpiler.graph.program" in statements
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT_DRIVER, *statements],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "FAILED: []" in done.stdout
    covered = int(re.search(r"COVERED: (\d+)", done.stdout).group(1))
    assert 0 < covered < len(statements) - 4, done.stdout  # the package's children saw what they load


def test_each_runtime_dependency_is_one_the_package_imports():
    """What ``pip install`` brings for the package (``[project] dependencies``) is what its modules import; the
    example's and the tests' libraries are extras."""
    import tomllib

    declared = {
        re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0].lower()
        for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    imported = set()
    for name in project_modules():
        path = ROOT / (name.replace(".", "/") + ".py")
        tree = ast.parse((path if path.exists() else ROOT / name.replace(".", "/") / "__init__.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    assert "torch" in declared and declared <= imported, declared - imported
    assert "rich" not in imported and "sklearn" not in imported


def test_the_wheel_installs_exactly_transpiler_and_passes(tmp_path):
    """The built wheel, installed into an empty target, puts ``transpiler`` and ``passes`` at the top of
    site-packages and nothing else besides its metadata (no tests, benches or examples)."""
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the tree
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, source],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("fx_transpiler-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES)
    target = tmp_path / "site-packages"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", target, wheel],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert installed.returncode == 0, installed.stderr
    listed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert listed == {"transpiler", "passes", "bin"}  # bin/: the `transpiler` command
    assert (target / "passes" / "fuse_allreduce.py").is_file() and (target / "transpiler" / "graph").is_dir()
