"""A tiny Llama whose GGUF holds llama.cpp's Q4_K_M mix of K-quant tensors (Q4_K for most
weights, Q6_K for `attn_v`, `ffn_down` and `output`, plus one Q5_K `attn_output` so every kernel
runs) gives the same logits on its own blocks as the same file dequantized to float32.

llama.cpp's quantizer (`llama_cpp`) is not installed in the test environment and gguf-py has no
K-quant quantizer, so the blocks are random (`tests.kernels.test_kernels_kquant.kquant_blocks`, with
fp16 scales chosen for weights of ~0.01-0.1): the check is the execution of the file's own values.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from laneserve.gpu_worker.gguf_loader import config_from_gguf, load_gguf_weights
from laneserve.gpu_worker.kquant import KQUANT_Q8K_MAX_TOKENS, KQuantEmbedding, KQuantLinear
from laneserve.gpu_worker.kquant import random_blocks as kquant_blocks
from laneserve.gpu_worker.model_runner import ModelRunner
from laneserve.gpu_worker.models.llama import LlamaForCausalLM
from laneserve.kernels import cpu_ext

H, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 300, 2
SCALE = {"Q4_K": 4e-4, "Q5_K": 2e-4, "Q6_K": 5e-5}  # fp16 d: weights of ~0.01-0.1
LAYER_TYPES = {  # gguf name: (qtype, rows, cols)
    "attn_q": ("Q4_K", H, H),
    "attn_k": ("Q4_K", H // HEADS * KV_HEADS, H),
    "attn_v": ("Q6_K", H // HEADS * KV_HEADS, H),
    "attn_output": ("Q5_K", H, H),
    "ffn_gate": ("Q4_K", INTER, H),
    "ffn_up": ("Q4_K", INTER, H),
    "ffn_down": ("Q6_K", H, INTER),
}


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(H // HEADS)
    writer.add_eos_token_id(2)
    tensors = {"token_embd.weight": ("Q4_K", VOCAB, H), "output.weight": ("Q6_K", VOCAB, H)}
    for i in range(LAYERS):
        tensors |= {f"blk.{i}.{name}.weight": spec for name, spec in LAYER_TYPES.items()}
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.8, 1.2, H).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for name, (qtype, rows, cols) in tensors.items():
        blocks = kquant_blocks(qtype, rows, cols, rng, SCALE[qtype])
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits(path, keep_quantized: bool, ids: list[int]) -> tuple[torch.Tensor, LlamaForCausalLM]:
    reader = gguf.GGUFReader(str(path))
    config = config_from_gguf(reader, path)
    weights = load_gguf_weights(reader, config, path, keep_quantized=keep_quantized)
    model = LlamaForCausalLM(config, weights, torch.float32, "cpu", quantization="auto")
    runner = ModelRunner(model, block_size=8, num_blocks=8)
    inputs = runner.prepare_inputs([ids], [0], [list(range(len(ids) // 8 + 1))], [True])
    inputs.logits_indices = torch.arange(len(ids))
    return runner.execute(inputs), model


# every part on the int8 GEMV, on the exact fp32 GEMV (LANESERVE_KQUANT_INT8=0), on the tiles
@pytest.mark.parametrize(("tokens", "int8"), [(5, True), (5, False), (40, False)])
def test_q4_k_m_file_runs_on_its_blocks_like_float32(q4_k_m_file, tokens, int8, monkeypatch):
    assert cpu_ext.load()
    monkeypatch.setenv("LANESERVE_KQUANT_INT8", "1" if int8 else "0")
    ids = [int(i) for i in np.random.default_rng(tokens).integers(0, VOCAB, tokens)]
    ref, dense = logits(q4_k_m_file, False, ids)
    ours, model = logits(q4_k_m_file, True, ids)
    assert isinstance(model.embed_tokens, KQuantEmbedding)
    assert isinstance(model.lm_head, KQuantLinear)
    layer = model.layers[0]
    assert all(
        isinstance(getattr(layer, f), KQuantLinear)
        for f in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    # the blocks only: ~0.56-0.82 bytes per weight against the float32 model's 4
    assert model.weight_bytes() < 0.25 * dense.weight_bytes()
    assert ref.std() > 0.1  # the random weights make a model whose logits move
    # the int8 GEMV rounds each linear's activations to int8 per 256 (as llama.cpp does)
    assert tokens <= min(KQUANT_Q8K_MAX_TOKENS.values()) or not int8
    tol = 2e-2 if int8 else 1e-4
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
