"""Host allocator settings for CPU inference.

Every CPU forward allocates and frees tens of megabytes of activations (gathered KV, attention
scores, MLP intermediates). glibc's malloc serves blocks above its dynamic mmap threshold with a
fresh ``mmap`` and gives freed heap tops back to the kernel (``M_TRIM_THRESHOLD``, 128 KiB by
default), so each step page-faults and zeroes the same memory again: on a 2-core EPYC with
bf16 weights a batch-64 decode step spent ~60 % of its wall time in the kernel (720 ms -> 260 ms
with the settings below; measured by scripts/bench_offline.py).

:func:`tune_for_inference` keeps freed memory in the process instead (the resident set then stays
at its peak, which a long-running worker reaches after its first large batches anyway). It is what
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` in the environment would
do (glibc ``mallopt(3)``), applied from inside the process so every entry point gets it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys

import numpy as np
import torch

from laneserve.contracts import env

logger = logging.getLogger(__name__)

ENV = "LANESERVE_MALLOC_TUNING"  # "0" leaves glibc's defaults alone

# mallopt(3) parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # keep up to ~2 GiB of freed heap top (mallopt takes an int)
TOP_PAD_BYTES = 256 * 1024 * 1024  # grow the heap in 256 MiB steps

_applied: bool | None = None


def tune_for_inference() -> bool:
    """Apply the allocator settings once per process; returns whether they are in effect.

    A no-op (returning False) off Linux/glibc or when ``LANESERVE_MALLOC_TUNING=0``. Never raises.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    try:
        wanted = env.get(ENV)
    except env.EnvError as exc:
        logger.warning("%s; tuning malloc anyway", exc)
        wanted = True
    if not wanted or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    _applied = ok
    logger.debug("glibc malloc tuned for inference: %s", ok)
    return ok


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, but on the CPU from `calloc`: the kernel hands out zero pages as they are
    first written instead of the process zero-filling them now (a KV cache of ~1 GB: ~1 s of a
    2-core worker's start, 0.1 s this way). Other devices: `torch.zeros`."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
