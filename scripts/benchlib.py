"""What the benchmark scripts share: the one CPU report (model, cores, flags, load) and the host
counters every result JSON carries. Torch-free and without side effects: a script that needs the
engines' OpenMP policy applies it itself before torch loads (`gpu_worker.openmp`).

Scripts import it by name (``from benchlib import cpu_info``): ``python scripts/NAME.py`` puts
scripts/ first on ``sys.path``, and ``tests/harness.load_script`` does the same while it loads
one, so no script edits ``sys.path`` to reach another.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_info() -> dict[str, Any]:
    """CPU model, flags and core count from /proc/cpuinfo (Linux), plus the load average now."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    simd = [f for f in flags.split() if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))]
    return {
        "model": model,
        "cores": os.cpu_count(),
        "simd_flags": simd,
        "flags": flags,
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's first line, jiffies), or None off Linux."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def steal_pct(before: list[int] | None, after: list[int] | None) -> float | None:
    """Percent of the CPU time between two `cpu_times` readings that the hypervisor gave other
    guests (steal, the 8th counter): on a shared virtual machine a run with a high figure ran
    on a slower machine than its neighbours in the same invocation."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return round(100.0 * (after[7] - before[7]) / total, 1) if total > 0 else None


def thread_settings() -> dict[str, Any]:
    """The OpenMP policy this run's torch engines start under (each engine's thread count is in
    its own entry)."""
    from laneserve.contracts import env

    return {name: env.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
