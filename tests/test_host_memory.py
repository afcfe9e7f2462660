"""``keep_freed_memory``: on the CPU, glibc keeps what a step frees, sized by the step's program, and leaves the
user's own allocator settings alone (``transpiler/runtime/host_memory.py``)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from bench.tiny_models import MLP, make_batch
from transpiler import Execution, StaticWorld, transpile
from transpiler.errors import ConfigurationError
from transpiler.graph.memory import largest_allocation_bytes, peak_transient_bytes
from transpiler.runtime import host_memory

LOSS = torch.nn.CrossEntropyLoss()
aten = torch.ops.aten
VIEWS_AND_IN_PLACE = {aten.t.default, aten.mul_.Tensor, aten.mul_.Scalar}
ROOT = Path(__file__).resolve().parent.parent
ON_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _step(hidden: int = 32, **settings):
    torch.manual_seed(0)
    model = MLP(hidden=hidden)
    batch = make_batch("mlp", 8, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    execution = Execution(**settings)
    return transpile(model, optimizer, "zero1", LOSS, batch, mesh=StaticWorld(size=2, rank=0), execution=execution)


@pytest.fixture
def mallopt(monkeypatch):
    """A recording stand-in for glibc's mallopt, in a process that has set nothing yet."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(host_memory, "_set", {})
    monkeypatch.setattr(host_memory, "_mallopt", lambda: lambda parameter, value: calls.append((parameter, value)) or 1)
    for name in (*host_memory.USER_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_thresholds_follow_the_program_and_only_rise(mallopt):
    big = _step(hidden=3000)  # a 3000x3000 weight: 34 MiB, above glibc's own 32 MiB ceiling
    graph = big.program.graph
    largest, peak = largest_allocation_bytes(graph), peak_transient_bytes(graph)
    assert largest >= 3000 * 3000 * 4 and peak >= largest
    assert dict(mallopt) == {
        host_memory.M_MMAP_THRESHOLD: largest + host_memory.MARGIN,
        host_memory.M_TRIM_THRESHOLD: 2 * peak + host_memory.MARGIN,
    }
    said = big.program.decisions["keep-freed-memory"]
    assert said.startswith(f"glibc keeps up to {(2 * peak + host_memory.MARGIN) / 2**20:.0f} MiB of freed memory")
    mallopt.clear()
    small = _step()  # needs less than what is set: nothing lowers it, and it says what holds
    assert mallopt == []
    assert small.program.decisions["keep-freed-memory"].split("; ")[0] == said.split("; ")[0]


def test_small_programs_keep_at_least_what_glibc_would(mallopt):
    _step()
    assert dict(mallopt) == {
        host_memory.M_MMAP_THRESHOLD: host_memory.GLIBC_MMAP_MAX,
        host_memory.M_TRIM_THRESHOLD: host_memory.GLIBC_TRIM_MAX,
    }


@pytest.mark.parametrize(
    "environ, said",
    [
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_ is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD loads jemalloc"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "LD_PRELOAD loads tcmalloc"),
    ],
)
def test_the_users_allocator_settings_are_left_alone(mallopt, monkeypatch, environ, said):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    step = _step()
    assert mallopt == []
    assert step.program.decisions["keep-freed-memory"] == f"glibc left as it is: {said}"


def test_keep_freed_memory_false_sets_nothing(mallopt):
    step = _step(keep_freed_memory=False)
    assert mallopt == [] and "keep-freed-memory" not in step.program.decisions


def test_keep_freed_memory_must_be_a_bool():
    with pytest.raises(ConfigurationError, match="'keep_freed_memory' of Execution wants a bool"):
        _step(keep_freed_memory=2)


@pytest.mark.skipif(not ON_GLIBC, reason="glibc's mallopt")
def test_a_freed_tensor_faults_no_pages_in_again_once_a_step_is_built():
    """In a fresh process a 40 MiB tensor, above glibc's 32 MiB ceiling, is mmapped and unmapped every time it is
    allocated: 10,000 minor page faults each time. Once a program whose largest tensor is larger is built, glibc
    serves it from its heap and keeps it when freed: once the heap has grown to hold it (glibc 2.36 places a
    64-byte aligned block a few times before a freed one fits), no pages to fault in."""
    code = textwrap.dedent(
        """
        import resource, torch
        from bench.tiny_models import MLP, make_batch
        from transpiler import StaticWorld, mode_config, transpile

        def faults(times=16):
            counts = []
            for _ in range(times):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                torch.ones(10 * 2**20)
                counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            return counts

        print(faults())
        model = MLP(hidden=3300)  # a 3300x3300 weight's gradient: 41.5 MiB
        batch = make_batch("mlp", 8, torch.Generator().manual_seed(0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = transpile(model, opt, "zero1", torch.nn.CrossEntropyLoss(), batch, world_size=2, rank=0)
        print(step.program.decisions["keep-freed-memory"])
        print(faults())
        """
    )
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    before, said, after = done.stdout.strip().splitlines()
    assert min(eval(before)) > 10_000, before  # 40 MiB is 10,240 pages
    assert said.startswith("glibc keeps up to") and "tensors of up to" in said, said
    assert max(eval(after)[-5:]) < 100, after  # once the heap has grown to hold it (2 to 6 times here)


OPS = {
    "add": lambda x: x + 1,
    "mul_": lambda x: x.mul_(2),  # in place: no new storage
    "t": lambda x: x.t(),  # a view
    "mm": lambda x: x @ x.t(),
    "cat": lambda x: torch.cat([x, x]),
    "relu": torch.relu,
    "sum": lambda x: x.sum(0, keepdim=True),
}


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8), rows=st.integers(1, 6))
def test_the_largest_allocation_is_within_the_peak(ops, rows):
    """What ``keep_freed_memory`` sizes its thresholds by: the largest tensor a program allocates is alive when
    it is made, so it is at most the peak, and the peak is at most every allocation summed."""

    def program(x):
        for op in ops:
            x = OPS[op](x)
        return x

    graph = make_fx(program)(torch.randn(rows, 3)).graph
    largest, peak = largest_allocation_bytes(graph), peak_transient_bytes(graph)
    allocated = [n.meta["val"] for n in graph.nodes if n.op == "call_function" and n.target not in VIEWS_AND_IN_PLACE]
    assert largest <= peak <= sum(t.numel() * t.element_size() for t in allocated)
    assert largest == max((t.numel() * t.element_size() for t in allocated), default=0)
