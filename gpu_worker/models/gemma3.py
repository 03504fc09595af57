"""Gemma 3 text decoder (`Gemma3ForCausalLM`) over the paged KV cache.

What differs from the Llama decoder it extends, after transformers' `modeling_gemma3.py`:
- embeddings scaled by sqrt(hidden) in the activation dtype (`Gemma3TextScaledWordEmbedding`);
- RMSNorm weights applied as (1 + w): folded into the stored weight at load, in fp32, so the
  kernels' RMSNorm runs unchanged;
- a norm after attention and after the MLP, besides the ones before (four per layer);
- GeLU-tanh gated MLP; q/k per-head RMSNorm before RoPE (as Qwen3);
- softmax scale `query_pre_attn_scalar ** -0.5`;
- "sliding_attention" layers attend the last `sliding_window` keys (i - W < j <= i) with RoPE base
  `rope_local_base_freq`, the others all keys with `rope_theta` (and its scaling);
- logits soft-capped as cap * tanh(logits / cap) when `final_logit_softcapping` is set.

Every attention path (C++, PyTorch reference, Triton) takes the layer's `sliding_window`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.model_config import ModelConfig
from laneserve.gpu_worker.models.checkpoint import WeightReader
from laneserve.gpu_worker.models.llama import (
    AttentionMetadata,
    LayerWeights,
    LlamaForCausalLM,
    gate_up,
)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`[..., 2I] -> [..., I]` = gelu_tanh(x[..., :I]) * x[..., I:] (Gemma's gated MLP), in x.dtype."""
    inter = x.shape[-1] // 2
    return F.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Gemma 3 text decoder; arguments and errors as `LlamaForCausalLM`."""

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)  # weights, dtype, device, quantization, ...
        self.scale = float(config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.embed_scale = config.hidden_size**0.5
        local = self._rope_cache(config.rope_local_base_freq or config.rope_theta, None)
        windows = self.sliding_windows  # a sliding layer has its local RoPE base too
        self.layer_rope = [self.cos_sin_cache if w is None else local for w in windows]

    def _norm(self, w: WeightReader, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Gemma's RMSNorm multiplies by (1 + w), computed in fp32."""
        return (1.0 + w.take(name, shape, torch.float32)).to(self.dtype)

    def _load_layer(self, w: WeightReader, i: int) -> LayerWeights:
        layer = super()._load_layer(w, i)
        h, p = (self.config.hidden_size,), f"model.layers.{i}."
        layer.pre_feedforward_layernorm = self._norm(w, p + "pre_feedforward_layernorm.weight", h)
        layer.post_feedforward_layernorm = self._norm(w, p + "post_feedforward_layernorm.weight", h)
        return layer

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, attn: AttentionMetadata, kv_caches, logits_indices,
        hidden_indices=None, pause=None,
    ):  # fmt: skip
        """As `LlamaForCausalLM.forward` (same arguments and shapes): logits [N, vocab] fp32,
        and with `hidden_indices` the final-norm rows [M, H] fp32 too."""
        eps = self.config.rms_norm_eps
        x = quant.embedding(input_ids, self.embed_tokens)  # [T, H], scaled in its dtype:
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ops = self._step_ops(x, positions, attn, kv_caches)
        residual = None
        layers = zip(self.layers, kv_caches, self.layer_rope, self.sliding_windows, strict=True)
        for i, (layer, cache, rope, window) in enumerate(layers):
            if i and pause:
                pause()
            if residual is None:
                residual = x
                h = ops.rms_norm(x, layer.input_layernorm, eps)
            else:
                h, residual = ops.rms_norm(x, layer.input_layernorm, eps, residual)
            o = self._attention(h, layer, cache, positions, attn, ops, rope, window)
            if pause:
                pause()
            o = ops.rms_norm(o, layer.post_attention_layernorm, eps)
            h, residual = ops.rms_norm(o, layer.pre_feedforward_layernorm, eps, residual)
            act = gate_up(h, layer.gate_up_proj, gelu_tanh_and_mul, pause)
            if pause:
                pause()
            m = quant.linear(act, layer.down_proj)
            x = ops.rms_norm(m, layer.post_feedforward_layernorm, eps)
        if pause:
            pause()
        out = self._logits(x, residual, logits_indices, ops, hidden_indices)
        logits, hidden = (out, None) if hidden_indices is None else out
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits if hidden is None else (logits, hidden)
