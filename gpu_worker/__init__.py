"""gpu_worker: one engine per accelerator (scheduler, paged KV cache, model runner, sampler) and the
worker process that connects it to the broker.

`from laneserve.gpu_worker import LLM, SamplingParams` is the offline API. Names are imported lazily so
that light users (the worker's IO side, the synthetic engine) do not pay for torch at import.
Importing the package changes nothing in the process (the OpenMP policy is applied by the entry
points, see gpu_worker/openmp.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "Engine", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "laneserve.gpu_worker.llm",
    "RequestOutput": "laneserve.gpu_worker.llm",
    "LLMEngine": "laneserve.gpu_worker.engine",
    "Engine": "laneserve.gpu_worker.engine_protocol",
    "EngineConfig": "laneserve.gpu_worker.config",
    "SamplingParams": "laneserve.gpu_worker.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
