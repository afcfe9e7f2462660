"""The ops every mode's step dispatches, counted exactly: the table ``tests/test_mode_ops_gate.py`` holds them to.

    python -m bench.mode_ops        # one torchrun world of 2 over gloo, about a minute; writes docs/performance.md

Each mode trains ``bench/models.py``'s two narrow models (the 12-block GPT of width 16 and the 16-block CNN with
BatchNorm: a step's cost there is the host's dispatching, ``bench/host_ops.py``) with AdamW (DeMo with plain SGD,
which it requires), at settings that make its rounds short (``SETTINGS``: every round-based mode syncs within
``WINDOW`` steps). After ``WARMUP`` steps (every program variant built and run once), the aten ops of the next
``WINDOW`` steps are counted (``bench/op_count.py``): *work* ops, about one kernel launch each on a GPU, and *views*.
Op counts do not depend on the machine or its load, only on the programs, the models and torch's decompositions,
so the suite can hold every mode to them (issue 77's regression gate: no mode's work ops more than 5% above the
table). A mode whose programs change on purpose records its new count with this command, and says so.
"""

from __future__ import annotations

import copy
import re
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.models import NARROW, narrow_batch
from bench.op_count import count_ops
from bench.two_ranks import entry, finish_rank, two_rank_results, write_section
from transpiler import TraceCache, transpile
from transpiler.strategies.modes import mode_config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- mode_ops -->", "<!-- /mode_ops -->"
PER_RANK = {"gpt": 4, "cnn": 8}
WARMUP, WINDOW = 4, 4
SLACK = 0.05  # the gate's margin over the recorded work ops
# mode -> its settings here: rounds of at most WINDOW steps, so the window sees each mode's syncs
SETTINGS: dict[str, dict] = {
    "none": {},
    "allreduce": {},
    "fused_allreduce": {},
    "local_sgd": {"k_steps": 2},
    "adaptive_local_sgd": {"k_steps": 2},
    "diloco": {"sync_every": 2},
    "streaming_diloco": {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1},
    "sparseloco": {"sync_every": 2},
    "demo": {},
    "adasum": {},
    "adasum_delta": {},
    "allgather": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "partial_sync": {"partitions": 2},
}
# dim_reduce is left out: it needs a PCA basis computed from a run of the model (docs/strategies/dim_reduce.md)


def label(mode: str) -> str:
    """The table's name for a mode at its settings here."""
    settings = SETTINGS[mode]
    return mode + (" (" + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")" if settings else "")


def _optimizer(mode: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if mode == "demo":  # DeMo steps SGD on the sign of the exchanged mean, and refuses anything else
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def counts(rank: int, world: int, models: str = ",".join(NARROW)) -> dict[str, dict[str, dict[str, int]]]:
    """``{model: {mode: {"work": n, "views": n}}}``: the ops of ``WINDOW`` steps after ``WARMUP``, on this rank
    of a live world (module docstring), for the narrow ``models`` named (comma-separated). A world job
    (``tests/worlds.py``) as well as the bench's rank body."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    loss_fn, traces = torch.nn.CrossEntropyLoss(), TraceCache()  # one trace per model and optimizer, every mode's
    for name in models.split(","):
        build = NARROW[name]
        torch.manual_seed(0)
        base = build()
        gen = torch.Generator().manual_seed(rank)
        batches = [narrow_batch(name, PER_RANK[name], gen) for _ in range(WARMUP + WINDOW)]
        out[name] = {}
        for mode, settings in SETTINGS.items():
            model = copy.deepcopy(base)
            config = mode_config(mode, **settings) if settings else mode
            step = transpile(model, _optimizer(mode, model), config, loss_fn, batches[0], trace=traces)
            for batch in batches[:WARMUP]:
                step(*batch)
            counter = count_ops(lambda step=step, window=batches[WARMUP:]: [step(*batch) for batch in window])
            out[name][mode] = {"work": counter.work, "views": counter.views}
    return out


def table(counted: dict[str, dict[str, dict[str, int]]]) -> str:
    """The docs' table: one row per mode, work ops and views of ``WINDOW`` steps per model."""
    head = " | ".join(f"{name} work | {name} views" for name in counted)
    lines = [f"| mode | {head} |", "|---" + "|---:" * 2 * len(counted) + "|"]
    for mode in SETTINGS:
        cells = " | ".join(f"{counted[n][mode]['work']} | {counted[n][mode]['views']}" for n in counted)
        lines.append(f"| {label(mode)} | {cells} |")
    return "\n".join(lines) + "\n"


def recorded(doc: Path = DOC) -> dict[str, dict[str, dict[str, int]]]:
    """The counts the docs' table holds, as :func:`counts` returns them."""
    text = doc.read_text().partition(BEGIN)[2].partition(END)[0]
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    names = re.findall(r"(\w+) work", text.partition("\n| mode")[2].partition("\n")[0])
    labels = {label(mode): mode for mode in SETTINGS}
    out: dict[str, dict[str, dict[str, int]]] = {name: {} for name in names}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        mode = labels.get(cells[0])
        if mode is None:
            continue
        for i, name in enumerate(names):
            out[name][mode] = {"work": int(cells[1 + 2 * i]), "views": int(cells[2 + 2 * i])}
    return out


def over_recorded(counted: dict, record: dict, slack: float = SLACK) -> list[str]:
    """Each mode and model whose work ops exceed the record by more than ``slack``, or that the record lacks."""
    out = []
    for name, modes in counted.items():
        for mode, ops in modes.items():
            limit = record.get(name, {}).get(mode)
            if limit is None:
                out.append(f"{mode} on {name}: not in the table (python -m bench.mode_ops records it)")
            elif ops["work"] > limit["work"] * (1 + slack):
                out.append(f"{mode} on {name}: {ops['work']} work ops, {ops['work'] / limit['work']:.2f}× the table's")
    return out


def rank_main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    finish_rank(out, counts(dist.get_rank(), dist.get_world_size()))


def main() -> None:
    ranks = two_rank_results(__file__, lambda out, _tmp: [out], port=29561)
    body = (
        f"`python -m bench.mode_ops` (W=2 over gloo, torch {torch.__version__}): aten ops of {WINDOW} steps after "
        f"{WARMUP}, rank 0 (the gate holds every rank to it); GPT {PER_RANK['gpt']} and CNN {PER_RANK['cnn']} samples "
        "per rank, AdamW (DeMo: SGD).\n\n" + table(ranks[0])
    )
    print(body)
    write_section(DOC, BEGIN, END, body)


if __name__ == "__main__":
    entry(rank_main, main)
