"""Write the graph each Boost/SINGA strategy produces for a tiny model to docs/strategies/graphs/.

    python bench/strategy_graphs.py

Each file is ``transpiler dump tests/models.py:tiny_factory --mode MODE -O ... --variant V --diff`` at
world size 2: the traced step against the rewritten one, as the strategy pages quote it.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from transpiler.cli import main  # noqa: E402

GRAPHS = {
    "accumulation": ("fused_allreduce", ["accumulate_steps=2"], ["accumulate", "step"]),
    "loss_scaling": ("fused_allreduce", ["loss_scale=dynamic"], ["step"]),
    "clipping": ("fused_allreduce", ["max_grad_norm=1.0"], ["step"]),
    "gradient_freeze": ("fused_allreduce", ["freeze_groups=2"], ["step/freeze1"]),
    "compression": ("fused_allreduce", ["compress=fp16"], ["step"]),
    "sparsification": ("fused_allreduce", ["sparsify=0.1"], ["step"]),
    "allgather": ("allgather", [], ["step"]),
    "partial_sync": ("partial_sync", [], ["sync0"]),
}


def dump(mode: str, options: list[str], variant: str) -> str:
    args = ["dump", str(ROOT / "tests/models.py") + ":tiny_factory", "--mode", mode, "--variant", variant, "--diff"]
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
    for name, (mode, options, variants) in GRAPHS.items():
        for variant in variants:
            command = (
                f"transpiler dump tests/models.py:tiny_factory --mode {mode} "
                + " ".join(f"-O {o}" for o in options)
                + f" --variant {variant} --diff"
            )
            path = folder / f"{name}.{variant.replace('/', '-')}.diff"
            path.write_text(f"# {command}\n{dump(mode, options, variant)}")
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    write()
