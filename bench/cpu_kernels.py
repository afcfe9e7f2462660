"""Does this CPU's ``mm`` give other bits when its output is a misaligned view? (issue 16)

Prints the CPU model and torch's CPU capability, then, under each setting that narrows the kernels
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``), how many random
float32/float64 ``mm`` and ``sum`` calls written with ``out=`` into a view at a given byte offset differ from
eager's fresh tensor. Offset 0 and multiples of 64 bytes are what the bucket buffers use; on an AVX2-only
AMD EPYC, MKL differs at every offset that is not a multiple of 16 bytes. ``.ci/run`` forces the settings
that reproduce this, so a wider CI machine checks the narrower one's bits too.

    python -m bench.cpu_kernels            # every setting, one subprocess each
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

SETTINGS: dict[str, dict[str, str]] = {
    "as found": {},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "all three at AVX2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}
OFFSETS_BYTES = (0, 4, 8, 16, 32, 64, 128, 256)


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def count_mismatches(trials: int = 40) -> dict[str, dict[int, int]]:
    """Per op and dtype, per byte offset: how many of ``trials`` random shapes differ from eager."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[int, int]] = {}
    for dtype in (torch.float32, torch.float64):
        size = dtype.itemsize
        for op in ("mm", "sum"):
            counts = dict.fromkeys(OFFSETS_BYTES, 0)
            for _ in range(trials):
                m, k, n = (int(v) for v in torch.randint(1, 70, (3,), generator=gen))
                a = torch.randn(k, m, dtype=dtype, generator=gen).t()
                b = torch.randn(k, n, dtype=dtype, generator=gen)
                shape = (m, n) if op == "mm" else (n,)
                numel = m * n if op == "mm" else n
                eager = torch.mm(a, b) if op == "mm" else torch.sum(b, [0])
                for offset in OFFSETS_BYTES:
                    if offset % size:
                        continue
                    buffer = torch.empty(offset // size + numel, dtype=dtype)
                    view = buffer[offset // size :].view(shape)
                    if op == "mm":
                        torch.mm(a, b, out=view)
                    else:
                        torch.sum(b, [0], out=view)
                    counts[offset] += not torch.equal(view, eager)
            out[f"{op} {str(dtype).removeprefix('torch.')}"] = {o: c for o, c in counts.items() if o % size == 0}
    return out


def main() -> None:
    if "--child" in sys.argv:
        import torch

        result = {"capability": torch.backends.cpu.get_cpu_capability(), "mismatches": count_mismatches()}
        print(json.dumps(result))
        return
    import torch

    print(f"CPU: {cpu_model()}; torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'setting':32} {'capability':10} differing out= views by byte offset (of 40 random shapes)")
    for label, env in SETTINGS.items():
        child = subprocess.run(
            [sys.executable, __file__, "--child"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        result = json.loads(child.stdout)
        cells = "; ".join(
            f"{op}: " + " ".join(f"{o}B={c}" for o, c in counts.items() if c) if any(counts.values()) else f"{op}: none"
            for op, counts in result["mismatches"].items()
        )
        print(f"{label:32} {result['capability']:10} {cells}")


if __name__ == "__main__":
    main()
