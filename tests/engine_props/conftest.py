"""Fixtures and Hypothesis settings for the property-based engine tests.

Settings and helpers: tests/engine_props/props_helpers.py.

`tiny_llama_dir` is a random 2-layer Llama (hidden 64) saved with `save_pretrained` next to the
bundled SmolLM2 tokenizer; its vocabulary is 64 rows wider than the tokenizer (as Qwen2 pads
its embedding), so ids the tokenizer cannot decode exist in the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_props.props_helpers import PADDED_VOCAB, TOKENIZER_LEN


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama (float32 weights) with the SmolLM2 tokenizer, EOS id 2."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=PADDED_VOCAB,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.15,  # peaked enough that top-p nuclei are often narrow
        bos_token_id=1,
        eos_token_id=2,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tokenizer) == TOKENIZER_LEN
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def make_engine(tiny_llama_dir):
    """Factory: make_engine(**EngineConfig fields) -> a float32 CPU `LLMEngine` on the tiny
    Llama, built once per distinct set of options."""
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import LLMEngine

    built: dict[tuple, LLMEngine] = {}

    def make(**kwargs) -> LLMEngine:
        kwargs = {"max_model_len": 256, "num_blocks": 64, **kwargs}
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
    from gpu_worker.model_loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
