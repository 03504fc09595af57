"""Fixtures and Hypothesis settings for the property-based engine tests.

Settings and helpers: tests/engine_props/props_helpers.py.

`tiny_llama_dir` is a random 2-layer Llama (hidden 64) saved with `save_pretrained` next to the
bundled SmolLM2 tokenizer; its vocabulary is 64 rows wider than the tokenizer (as Qwen2 pads
its embedding), so ids the tokenizer cannot decode exist in the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_props.props_helpers import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama (float32 weights) with the SmolLM2 tokenizer, EOS id 2."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def make_engine(tiny_llama_dir):
    """Factory: make_engine(cache=True, **EngineConfig fields) -> a float32 CPU `LLMEngine` on
    the tiny Llama, built once per distinct set of options (or afresh with cache=False)."""
    from laneserve.gpu_worker.config import EngineConfig
    from laneserve.gpu_worker.engine import LLMEngine

    built: dict[tuple, LLMEngine] = {}

    def make(cache: bool = True, **kwargs) -> LLMEngine:
        kwargs = {"max_model_len": 256, "num_blocks": 64, **kwargs}
        if not cache:
            return LLMEngine(
                EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", **kwargs)
            )
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            config = EngineConfig(
                model=str(tiny_llama_dir), dtype="float32", device="cpu", **kwargs
            )
            built[key] = LLMEngine(config)
        engine = built[key]
        assert not engine.has_unfinished_requests(), "a previous test left requests behind"
        return engine

    return make


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """The bundled SmolLM2 tokenizer (byte-level BPE)."""
    from laneserve.gpu_worker.model_loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
