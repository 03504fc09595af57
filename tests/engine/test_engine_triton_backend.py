"""The engine with the Triton backend forced (interpreted on CPU) gives the same greedy tokens as the
PyTorch backend, on a tiny random Llama (issue 4)."""

from __future__ import annotations

import pytest
import torch

from laneserve.gpu_worker import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=128,
        eos_token_id=2,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out)
    return out


@pytest.mark.slow
def test_triton_forced_engine_matches_torch(tiny_llama, monkeypatch):
    prompts = [[5, 6, 7], list(range(100, 120)), list(range(300, 309))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(
            model=str(tiny_llama),
            dtype="float32",
            block_size=8,
            num_blocks=32,
            max_model_len=128,
            max_num_batched_tokens=16,
        )
        outs = llm.generate(prompts, params)
        llm.check_integrity()
        return [o.token_ids for o in outs]

    monkeypatch.setenv("LANESERVE_ATTENTION_BACKEND", "torch")
    expect = run()
    monkeypatch.setenv("LANESERVE_ATTENTION_BACKEND", "triton")
    assert run() == expect
