"""The layout of a weight trajectory and the PCA basis built from it (DimReduce, issue 8).

A trajectory (``transpile(..., save_trajectory=DIR)``, ``runtime/trajectory.py``) and a basis flatten the
trainable parameters the same way: every trainable parameter in ``model.named_parameters()`` order (tied
parameters once), each flattened row-major, concatenated.

``transpiler pca DIR --components k -o pca.pt`` centres the snapshots and
takes the top-k right singular vectors of the centred matrix
(``torch.linalg.svd``), the principal directions, and writes
``{"pca_mat": k × n, "mean": n, "explained_variance_ratio": k, "names",
"shapes", "steps"}``. ``dim-reduce`` reads it (:func:`read_basis`) and checks it fits the model.
"""

from __future__ import annotations

import functools
import hashlib
import io
from pathlib import Path

import torch

from transpiler.errors import ConfigurationError


def layout(model: torch.nn.Module) -> tuple[list[str], list[list[int]]]:
    """Names and shapes of the trainable parameters, in the order trajectories and bases flatten them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [list(p.shape) for _, p in named]


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters() if p.requires_grad])


def compute_basis(directory: Path, components: int) -> dict:
    """The top-``components`` principal directions of the saved snapshots, with their layout."""
    files = sorted(Path(directory).glob("step_*.pt"))
    if len(files) < 2:
        raise ConfigurationError(
            f"{directory} holds {len(files)} trajectory snapshot(s) (step_*.pt); PCA needs at least 2. Train with "
            "transpile(..., save_trajectory=DIR, trajectory_every=m) first."
        )
    snapshots = [torch.load(f, weights_only=True) for f in files]
    first = snapshots[0]
    for f, s in zip(files, snapshots):
        if s["names"] != first["names"] or s["shapes"] != first["shapes"]:
            raise ConfigurationError(f"{f.name} was saved from another model than {files[0].name}: layouts differ.")
    weights = torch.stack([s["weights"].double() for s in snapshots])
    most = min(weights.shape[0] - 1, weights.shape[1])
    if not 1 <= components <= most:
        raise ConfigurationError(
            f"--components {components}: {len(files)} snapshots of {weights.shape[1]} weights give at most "
            f"{most} principal directions (centring removes one). Save more snapshots or ask for fewer."
        )
    mean = weights.mean(0)
    _, singular, vh = torch.linalg.svd(weights - mean, full_matrices=False)
    variance = singular**2
    return {
        "pca_mat": vh[:components].float().contiguous(),
        "mean": mean.float(),
        "explained_variance_ratio": (variance[:components] / variance.sum()).float(),
        "names": first["names"],
        "shapes": first["shapes"],
        "steps": [s["step"] for s in snapshots],
    }


def load_basis(path: str | Path, model: torch.nn.Module) -> dict:
    """A basis written by ``transpiler pca``, checked against the model it will be used with."""
    basis = read_basis(path)
    check_layout(basis, *layout(model), path)
    return basis


def read_basis(path: str | Path) -> dict:
    """A basis written by ``transpiler pca``, with ``digest`` (SHA-256 of the file: ranks compare it).

    Cached by path, size and modification time: every rank's program and every variant reads it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(
            f"no PCA basis at {path}; build one with 'transpiler pca TRAJECTORY_DIR -k K -o {path}'."
        )
    stat = path.stat()
    return _read_basis(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_basis(path: str, size: int, mtime_ns: int) -> dict:
    data = Path(path).read_bytes()
    try:
        basis = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # pickle, zip and weights-only errors all mean "not ours"
        raise ConfigurationError(f"{path} is not a basis written by 'transpiler pca' ({type(exc).__name__}).") from None
    if not isinstance(basis, dict) or not {"pca_mat", "names", "shapes"} <= set(basis):
        raise ConfigurationError(f"{path} is not a basis written by 'transpiler pca' (no pca_mat/names/shapes).")
    return basis | {"digest": hashlib.sha256(data).hexdigest()}


def check_layout(basis: dict, names: list[str], shapes: list[list[int]], path: str | Path) -> None:
    """The basis was built for trainable parameters with these names and shapes, in this order."""
    if (basis["names"], basis["shapes"]) == (names, shapes):
        return
    mine = dict(zip(names, shapes))
    theirs = dict(zip(basis["names"], basis["shapes"]))
    differ = [
        f"{n}: basis {theirs.get(n)}, model {mine.get(n)}"
        for n in dict.fromkeys([*theirs, *mine])
        if theirs.get(n) != mine.get(n)
    ]
    raise ConfigurationError(
        f"{path} was built for another model (its trainable parameters differ: {'; '.join(differ[:4]) or 'order'})."
        " Save a trajectory of this model and run 'transpiler pca' on it."
    )
