"""gpu_worker: one engine per accelerator (scheduler, paged KV cache, model runner, sampler) and the
worker process that connects it to the broker.

`from gpu_worker import LLM, SamplingParams` is the offline API. Names are imported lazily so
that light users (the worker's IO side, the synthetic engine) do not pay for torch at import.
"""

from __future__ import annotations

import os
from typing import Any

# OpenMP wait policy, read by libgomp when torch initialises it (so set before torch loads):
# - libgomp's default spins ~3 ms at every barrier, which makes torch's CPU ops 10-30x slower when
#   another process holds a core (0.4 ms -> 20 ms for a [4, 576] x [576, 1536] matmul);
# - a fully passive team pays ~40 us to wake its threads at *every* parallel region (a bf16
#   batch-64 decode step of SmolLM2: 160 ms);
# - a short spin (3000 iterations, ~30 us) catches the next op's region while the threads are
#   still awake (the same step: 97 ms) and gives the core up soon after.
# An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins (the test suite, which
# runs many processes on 2 cores, sets both to passive).
DEFAULT_GOMP_SPINCOUNT = "3000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["GOMP_SPINCOUNT"] = DEFAULT_GOMP_SPINCOUNT

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "gpu_worker.llm",
    "RequestOutput": "gpu_worker.llm",
    "LLMEngine": "gpu_worker.engine",
    "EngineConfig": "gpu_worker.engine",
    "SamplingParams": "gpu_worker.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
