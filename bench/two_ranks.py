"""What the W=2 benches share: run a script under torchrun with two ranks (one thread each), read the JSON that
rank 0 wrote, and put a rendered table between two markers of a docs page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_two_ranks(script: str, args: list[str], port: int, timeout: float = 1800, world: int = 2) -> None:
    """``script`` under ``torchrun --nproc-per-node <world>`` (2 unless given) with ``args``, from the repository
    root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    subprocess.run([*cmd, script, *args], check=True, timeout=timeout, env=env, cwd=ROOT)


def two_rank_results(script: str, args: Callable[[str, str], list[str]], port: int, world: int = 2) -> Any:
    """Run ``script`` at W=2 (or ``world``) with ``args(result_path, scratch_dir)`` and return the JSON its rank 0
    wrote to ``result_path``; the scratch folder is deleted afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run_two_ranks(script, args(str(out), tmp), port, world=world)
        return json.loads(out.read_text())


def write_section(doc: Path, begin: str, end: str, body: str) -> None:
    """Replace what ``doc`` holds between the markers ``begin`` and ``end`` with ``body`` (nothing if the page
    has no such markers)."""
    text = doc.read_text()
    if begin in text:
        head, _, rest = text.partition(begin)
        doc.write_text(head + begin + "\n" + body + end + rest.partition(end)[2])


def entry(rank_main: Callable[[str], None], main: Callable[[], None]) -> None:
    """A two-rank bench's ``__main__``: under torchrun a rank (``rank_main(result_path)``), else the driver."""
    if "RANK" in os.environ:
        rank_main(sys.argv[1])
    else:
        main()


def finish_rank(out: str, result: Any) -> None:
    """A bench rank's end: every rank's ``result`` gathered, rank 0 writes them as JSON to ``out``, and the
    process exits without ``destroy_process_group()`` (torch 2.13 can deadlock there, bench/memory.py)."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    sys.stdout.flush()
    os._exit(0)
