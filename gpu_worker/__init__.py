"""gpu_worker: one engine per accelerator (scheduler, paged KV cache, model runner, sampler) and the
worker process that connects it to the broker.

`from gpu_worker import LLM, SamplingParams` is the offline API. Names are imported lazily so
that light users (the worker's IO side, the synthetic engine) do not pay for torch at import.
"""

from __future__ import annotations

import os
from typing import Any

# libgomp's default busy-wait makes torch's CPU ops 10-30x slower when another process holds a
# core (measured here: 0.4 ms -> 20 ms for a [4, 576] x [576, 1536] matmul). Must be set before
# torch initialises OpenMP; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
