from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_dir):
    from laneserve.gpu_worker.model_loader import load_model_files

    return load_model_files(smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own LlamaForCausalLM loaded from the same GGUF (float32, eval)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()
