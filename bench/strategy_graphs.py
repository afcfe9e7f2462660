"""Write the graph each Boost/SINGA strategy produces for a tiny model to docs/strategies/graphs/.

    python -m bench.strategy_graphs

Each file is ``transpiler dump bench/tiny_models.py:tiny_factory --mode MODE -O ... --variant V --diff`` at
world size 2: the traced step against the rewritten one, as the strategy pages quote it. DimReduce uses
``plain_sgd_factory`` (its plain SGD) and a random 3-row basis for that model (``BASIS``), so that world
size 2 pads one row.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from pathlib import Path

import torch

from bench.tiny_models import plain_sgd_factory
from transpiler.cli import main
from transpiler.graph.basis import layout

ROOT = Path(__file__).resolve().parent.parent

BASIS = "{basis}"  # replaced by a basis file written for the run

GRAPHS = {
    "accumulation": ("fused_allreduce", ["accumulation.steps=2"], ["accumulate", "step"]),
    "loss_scaling": ("fused_allreduce", ["loss_scaling.dynamic=true"], ["step"]),
    "clipping": ("fused_allreduce", ["clipping.max_norm=1.0"], ["step"]),
    "gradient_freeze": ("fused_allreduce", ["freeze.groups=2"], ["step/freeze1"]),
    "compression": ("fused_allreduce", ["compression.wire_dtype=fp16"], ["step"]),
    "sparsification": ("fused_allreduce", ["sparsification.ratio=0.1"], ["step"]),
    "allgather": ("allgather", [], ["step"]),
    "partial_sync": ("partial_sync", [], ["sync0"]),
    "dim_reduce": ("dim_reduce", [f"pca_path={BASIS}"], ["step"]),
    "zero3": ("zero3", ["bucket_cap_mb=0.0005", "first_bucket_mb=0.0001"], ["step"]),
}


def factory(mode: str) -> str:
    return "bench/tiny_models.py:" + ("plain_sgd_factory" if mode == "dim_reduce" else "tiny_factory")


def write_basis(folder: Path) -> Path:
    model, *_ = plain_sgd_factory()
    names, shapes = layout(model)
    rows = torch.randn(3, sum(math.prod(s) for s in shapes), generator=torch.Generator().manual_seed(0))
    path = folder / "basis.pt"
    torch.save({"pca_mat": rows, "names": names, "shapes": shapes}, path)
    return path


def dump(mode: str, options: list[str], variant: str) -> str:
    args = ["dump", str(ROOT / factory(mode)), "--mode", mode, "--variant", variant, "--diff"]
    for option in options:
        args += ["-O", option]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        if main(args) != 0:
            raise SystemExit(f"transpiler {' '.join(args)} failed")
    return out.getvalue()


def write() -> None:
    folder = ROOT / "docs" / "strategies" / "graphs"
    folder.mkdir(parents=True, exist_ok=True)
    basis = write_basis(Path(tempfile.mkdtemp()))
    for name, (mode, written, variants) in GRAPHS.items():
        options = [o.replace(BASIS, str(basis)) for o in written]
        for variant in variants:
            command = (
                f"transpiler dump {factory(mode)} --mode {mode} "
                + " ".join(f"-O {o}" for o in written)
                + f" --variant {variant} --diff"
            )
            path = folder / f"{name}.{variant.replace('/', '-')}.diff"
            path.write_text(f"# {command}\n{dump(mode, options, variant)}")
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    write()
