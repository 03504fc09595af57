"""The device and CPU this process runs on: the CPU's feature flags (read once from
/proc/cpuinfo), whether it has native bf16, the default device and dtype they imply (DESIGN.md:
`dtype="auto"` is bfloat16 on a GPU or a CPU with AMX/AVX512-BF16, float32 otherwise), and the
CPU's identity for cache keys (`cpu_identity`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo, read once; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU advertises AMX-BF16 or AVX512-BF16."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on a GPU or a CPU with AMX/AVX512-BF16, float32 otherwise (DESIGN.md).

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[dtype]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_identity() -> str:
    """The CPU's model name and flags lines of /proc/cpuinfo, each distinct line once (the
    platform's processor name where there is none): what identifies a CPU in a cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(dict.fromkeys(keep))  # each distinct line once (one per core otherwise)
