"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) over a paged KV
cache.

The forward pass takes one flattened varlen batch (DESIGN.md, "Model runner"): every scheduled
request contributes its new tokens to `input_ids[T]`; attention reads each request's whole context
from the paged cache through its block table. Layer numerics follow Hugging Face's
`modeling_llama.py` (RMSNorm in fp32, rotate-half RoPE, SwiGLU MLP) so float32 logits match
transformers to ~1e-5. Qwen3 adds an RMSNorm over each q and k head before RoPE
(`modeling_qwen3.py`, `Qwen3Attention`). Mixtral and Qwen3-MoE layers listed in
`ModelConfig.moe_layers` run a sparse MoE block instead of the MLP (`models/moe.py`).

Weights use fused projections (`qkv_proj` = cat(q, k, v), `gate_up_proj` = cat(gate, up)), one matmul
each instead of three/two. With `quantization` other than "none" the projections and the LM head
are `gpu_worker.quantization.QuantLinear`s (weight-only int4/int8) and a Q8_0 embedding stays in
its blocks (DESIGN.md "Quantization").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from laneserve import kernels
from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.gemv_blocks import GemvBlocks
from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor
from laneserve.gpu_worker.model_config import ModelConfig
from laneserve.gpu_worker.models import moe
from laneserve.gpu_worker.models.checkpoint import Linear, WeightReader
from laneserve.gpu_worker.models.rope import build_cos_sin_cache
from laneserve.gpu_worker.quantization import QuantLinear

# A paused forward of this many rows or more runs each gate/up in two halves: each half takes the
# route the whole takes (`quantization.linear`'s `rows`: the kernels' row thresholds are told the
# whole's rows; each half has at least 96, past every small-row route's). 192, not 256: on a
# 2-core AVX2 EPYC a bulk job's steps within the split's time target held ~210 tokens, under 256,
# so they fell back to the unsplit target (~93 tokens, 12 % dearer a token: docs/benchmarks.md
# Run 32)
SPLIT_ROWS = 192


def gate_up(
    h: torch.Tensor, linear: Linear, act: Callable[[torch.Tensor], torch.Tensor], pause=None
) -> torch.Tensor:
    """`act(h @ gate_up)` [T, I]. In a paused forward (`pause`) of `SPLIT_ROWS` rows or more,
    in two row halves with a pause between: a gate/up holds twice the weights of a down
    projection, the longest segment between pauses otherwise. At these rows the GEMM is
    compute-bound, so reading its weights twice costs little; a smaller step (a batch's decode
    rows) runs it whole, and is short. Each half runs the kernel the whole would (`rows`): on a
    CPU with AMX a 513-1,024-row step's halves otherwise left the dense copy for the AMX matmul
    over the 4-bit blocks, whose SmolLM2 gate/up is ~1.1-1.3x slower there (docs/benchmarks.md
    Run 37)."""
    rows = h.shape[0]
    if pause is None or rows < SPLIT_ROWS:
        return act(quant.linear(h, linear))
    half = rows // 2
    first = act(quant.linear(h[:half], linear, rows=rows))
    pause()
    return torch.cat([first, act(quant.linear(h[half:], linear, rows=rows))])


def pause_pieces(c: ModelConfig, split: bool = True) -> float:
    """What a paused forward of `SPLIT_ROWS` rows or more (`split`; else a shorter one, whose
    gate/up runs whole) is cut into by its pauses (`LlamaForCausalLM.forward`: before each
    layer, after its attention block, inside and after its MLP's gate/up -- a MoE layer's
    experts run whole -- and before the LM head), counted for the longest wait they leave:
    all the layers' weights over the largest segment's anywhere (attention block;
    half a gate/up; down; a MoE layer's experts a token runs, with the router). SmolLM2's four
    segments a layer hold a quarter of its weights each: 120 pieces for its 30 layers. Weights
    stand for time: a deep prefill's attention, or a MoE prefill touching every expert, runs
    longer than its weights say."""
    h, d = c.hidden_size, c.head_dim
    attention = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    half_gate_up = h * c.intermediate_size
    gate_up_parts = (half_gate_up, half_gate_up) if split else (2 * half_gate_up,)
    dense = (attention, *gate_up_parts, h * c.intermediate_size)
    experts = 3 * h * c.moe_intermediate_size * c.num_experts_per_tok + h * c.num_experts
    segments = [
        part
        for i in range(c.num_hidden_layers)
        for part in ((attention, experts) if i in c.moe_layers else dense)
    ]
    return sum(segments) / max(segments)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout shared by every layer.

    slot_mapping: int64 [T]        flat cache slot (block * block_size + offset) of each new token
    cu_seqlens_q: int32 [B + 1]    query_start_loc: request b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    seq_lens:     int32 [B]        context length of each request including this step's tokens
    block_tables: int32 [B, max_blocks]
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


@dataclass(slots=True)
class LayerWeights:
    input_layernorm: torch.Tensor  # [H]
    qkv_proj: Linear  # [(Hq + 2 Hk) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hk) * D] (Qwen2)
    o_proj: Linear  # [H, Hq * D]
    post_attention_layernorm: torch.Tensor  # [H]
    gate_up_proj: Linear | None  # [2 I, H]; None in a sparse MoE layer
    down_proj: Linear | None  # [H, I]
    q_norm: torch.Tensor | None = None  # [D] per-head RMSNorm weight before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [D]
    pre_feedforward_layernorm: torch.Tensor | None = None  # [H] (Gemma 3)
    post_feedforward_layernorm: torch.Tensor | None = None  # [H] (Gemma 3)
    moe: moe.MoEWeights | None = None  # the MoE block replacing the MLP (Mixtral, Qwen3-MoE)


class LlamaForCausalLM:
    """The decoder: embeddings, `num_hidden_layers` layers, final norm and LM head.

    Args:
        config: the model's shape.
        weights: float32 tensors in Hugging Face naming, or GGUF blocks (see `model_loader`,
            `gguf_loader`).
        dtype: activation dtype (torch.float32 or torch.bfloat16 / float16), and the dense
            weights' dtype.
        device: where weights live.
        quantization: "none" (dense weights in `dtype`), "auto" (GGUF Q4_0/Q4_1/Q8_0 weights on
            their own kernels), "int8" or "int4" (every linear on that kernel); on CUDA
            only "int4" with bfloat16 activations, and "auto" = "none"
            (`quantization.resolve_mode`).

    Raises:
        ModelLoadError: a weight is missing or has the wrong shape.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor | GGUFQuantTensor],
        dtype,
        device,
        quantization: str = "none",
        release_weights: bool = False,  # `weights` is ours: free each part once it is built
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quant.resolve_mode(quantization, self.device, dtype)
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        w = WeightReader(
            weights, dtype, self.device, self.quantization, config.architecture, release_weights
        )
        self._load_embedding(w)
        self.norm = self._norm(w, "model.norm.weight", (config.hidden_size,))
        self._load_lm_head(w)
        self.layers = [self._load_layer(w, i) for i in range(config.num_hidden_layers)]
        self.cos_sin_cache = self._rope_cache(config.rope_theta, config.rope_scaling)
        # each layer's sliding window (tokens; None: full attention), as its attention takes it
        self.sliding_windows = [
            config.layer_sliding_window(i) for i in range(config.num_hidden_layers)
        ]

    def _rope_cache(self, theta: float, scaling: dict | None) -> torch.Tensor:
        """fp32 [max_model_len, rotary_dim] cos/sin cache (`models.rope`)."""
        c = self.config
        max_pos = c.max_position_embeddings or c.max_model_len
        args = (theta, scaling, c.rotary_dim, max_pos, c.max_model_len, self.device)
        return build_cos_sin_cache(*args)

    def _load_embedding(self, w: WeightReader) -> None:
        """The token embedding: Q8_0 blocks stay quantized on the CPU (`build_embedding`)."""
        c = self.config
        vh = (c.vocab_size, c.hidden_size)
        embed_mode = self.quantization if self.device.type == "cpu" else "none"  # CUDA: dense
        self.embed_tokens = quant.build_embedding(
            w.raw("model.embed_tokens.weight", vh), embed_mode, self.dtype
        )
        if isinstance(self.embed_tokens, torch.Tensor):
            self.embed_tokens = self.embed_tokens.to(self.device)

    def _load_lm_head(self, w: WeightReader) -> None:
        """The LM head: its own weight, or tied to the embedding (the same tensor when both are
        dense; a quantized head over a Q8_0 embedding reads the embedding's blocks)."""
        c = self.config
        embed_name, vh = "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
        head_name = embed_name
        if not c.tie_word_embeddings and "lm_head.weight" in w.weights:
            head_name = "lm_head.weight"
        tied_dense = head_name == embed_name and isinstance(self.embed_tokens, torch.Tensor)
        # one tensor for both; on CUDA a tied head stays the dense table (int4 would requantize
        # the GGUF's Q8_0 table and hold a second copy of the largest matrix)
        if tied_dense and (
            self.device.type != "cpu"
            or quant.build_is_dense([w.raw(head_name, vh)], self.quantization)
        ):
            self.lm_head: Linear = self.embed_tokens
            return
        table, blocks = self.embed_tokens, None
        if head_name == embed_name and isinstance(table, quant.Q8Embedding):
            blocks = GemvBlocks("q8_0", table.qs, table.d)  # the embedding's own arrays
        self.lm_head = head = w.take_linear([head_name], [vh], blocks)
        if blocks is not None and isinstance(head, QuantLinear) and head.kind == "int8":
            head.read_q8_0_blocks(blocks)  # few-row calls read them: exact, one copy
        w.drop({embed_name, head_name})  # both built

    def _load_layer(self, w: WeightReader, i: int) -> LayerWeights:
        """Layer `i`'s weights, q/k/v and gate/up fused into one linear each."""
        h, inter = self.config.hidden_size, self.config.intermediate_size
        p = f"model.layers.{i}."
        bias = None
        if self.config.attention_bias:
            bias = torch.cat(
                [
                    w.take(p + "self_attn.q_proj.bias", (self.q_size,)),
                    w.take(p + "self_attn.k_proj.bias", (self.kv_size,)),
                    w.take(p + "self_attn.v_proj.bias", (self.kv_size,)),
                ]
            )
        q_norm = k_norm = None
        if self.config.qk_norm:
            d = (self.config.head_dim,)
            q_norm = self._norm(w, p + "self_attn.q_norm.weight", d)
            k_norm = self._norm(w, p + "self_attn.k_norm.weight", d)
        sparse = i in self.config.moe_layers
        return LayerWeights(
            input_layernorm=self._norm(w, p + "input_layernorm.weight", (h,)),
            qkv_proj=w.take_layer_linear(p, "qkv_proj", [self.q_size, *[self.kv_size] * 2], h),
            qkv_bias=bias,
            o_proj=w.take_layer_linear(p, "o_proj", [h], self.q_size),
            post_attention_layernorm=self._norm(w, p + "post_attention_layernorm.weight", (h,)),
            gate_up_proj=None if sparse else w.take_layer_linear(p, "gate_up_proj", [inter] * 2, h),
            down_proj=None if sparse else w.take_layer_linear(p, "down_proj", [h], inter),
            moe=moe.load_moe(w, self.config, i) if sparse else None,
            q_norm=q_norm,
            k_norm=k_norm,
        )

    def _norm(self, w: WeightReader, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An RMSNorm weight as the kernels multiply it (Gemma overrides: 1 + w)."""
        return w.take(name, shape)

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a step takes no host-side decision from tensor values (CUDA-graph capture):
        not with quantized MoE experts, which run grouped by expert with a host-side count."""
        return all(layer.moe is None or layer.moe.w13 is not None for layer in self.layers)

    def weight_bytes(self) -> int:
        """Bytes held by the weights (quantized blocks, scales and dense copies; a tied LM head
        counted once)."""
        layers = [getattr(layer, f) for layer in self.layers for f in LayerWeights.__slots__]
        tensors = [self.embed_tokens, self.norm, *(t for t in layers if t is not None)]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        shared = getattr(self.lm_head, "gemv", None)  # the embedding's arrays, counted there
        if shared is None or shared.qs is not getattr(self.embed_tokens, "qs", None):
            shared = None
        # (a block-order copy, `GemvBlocks.qs_blocks`, is the head's own)
        return sum(quant.nbytes(t) for t in tensors) - (
            quant.nbytes(shared.qs) + quant.nbytes(shared.scale) if shared else 0
        )

    def prepare_gemv_blocks(self) -> None:
        """Put the C++ GEMVs' int4 and Q8_0 weights in the built kernel's order now
        (`GemvBlocks.prepare`; needs `kernels.cpu_ext.load()`), not in the first step."""
        layers = [getattr(layer, f) for layer in self.layers for f in LayerWeights.__slots__]
        experts = [t for layer in self.layers if layer.moe for t in layer.moe.linears()]
        for weight in [*layers, *experts, self.lm_head]:
            gemv = getattr(weight, "gemv", None)
            if gemv is not None:
                gemv.prepare()

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights, ops) -> None:
        """Qwen3: RMSNorm over each head's D features of the q and k parts of `qkv`
        [T, (Hq + 2Hk) D], in place, before RoPE."""
        d, eps, q_end = self.config.head_dim, self.config.rms_norm_eps, self.q_size
        k_end = q_end + self.kv_size
        for start, end, weight in ((0, q_end, layer.q_norm), (q_end, k_end, layer.k_norm)):
            heads = qkv[:, start:end].reshape(-1, d)  # [T * heads, D], a contiguous copy
            qkv[:, start:end] = ops.rms_norm(heads, weight, eps).view(qkv.shape[0], -1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hk, D]
        logits_indices: torch.Tensor,  # int64 [N] rows of the batch that emit a token
        hidden_indices: torch.Tensor | None = None,  # int64 [M] rows pooled for embeddings
        pause: Callable[[], None] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the decoder over one varlen batch; returns logits [N, vocab] (fp32), and with
        `hidden_indices` also those rows' final-norm hidden states [M, H] (fp32).
        `pause` is called at the pass's pause points (before every layer but the first, after
        its attention block, inside (`gate_up`) and after its MLP's gate/up -- not inside a MoE
        block -- and before the LM head) where other steps may run (gpu_worker/interleave.py;
        this one's tensors and KV slots are its own)."""
        eps = self.config.rms_norm_eps
        x = quant.embedding(input_ids, self.embed_tokens)  # [T, H]
        ops = self._step_ops(x, positions, attn, kv_caches)
        residual = None
        layers = zip(self.layers, kv_caches, self.sliding_windows, strict=True)
        for i, (layer, cache, window) in enumerate(layers):
            if i and pause:
                pause()
            if residual is None:
                residual = x
                h = ops.rms_norm(x, layer.input_layernorm, eps)
            else:
                h, residual = ops.rms_norm(x, layer.input_layernorm, eps, residual)
            x = self._attention(h, layer, cache, positions, attn, ops, self.cos_sin_cache, window)
            if pause:
                pause()
            h, residual = ops.rms_norm(x, layer.post_attention_layernorm, eps, residual)
            if layer.moe is not None:
                x = moe.forward(h, layer.moe, ops.silu_and_mul)
                continue
            act = gate_up(h, layer.gate_up_proj, ops.silu_and_mul, pause)
            if pause:
                pause()
            x = quant.linear(act, layer.down_proj)
        if pause:
            pause()
        return self._logits(x, residual, logits_indices, ops, hidden_indices)

    def _step_ops(self, x, positions, attn: AttentionMetadata, kv_caches):
        """This step's layer ops (`kernels.step_ops`, checked once for every layer)."""
        return kernels.step_ops(
            x,
            self.norm,
            kv_caches[0][0],
            kv_caches[0][1],
            positions,
            attn.slot_mapping,
            self.cos_sin_cache,
            attn.seq_lens,
            attn.block_tables,
        )

    def _attention(
        self,
        h: torch.Tensor,  # [T, H] normed hidden states
        layer: LayerWeights,
        cache: torch.Tensor,  # [2, num_blocks, block_size, Hk, D]
        positions: torch.Tensor,
        attn: AttentionMetadata,
        ops,
        cos_sin_cache: torch.Tensor,  # [max_model_len, rot_dim]
        window: int | None = None,  # attend keys i - window < j <= i (None: all)
    ) -> torch.Tensor:
        """One layer's attention block up to and including o_proj: [T, H]."""
        c = self.config
        qkv = quant.linear(h, layer.qkv_proj, layer.qkv_bias)  # [T, (Hq + 2Hk) D]
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer, ops)
        q = ops.rope_and_cache(  # [T, Hq, D]; rotated k and v go to the cache
            qkv,
            positions,
            cos_sin_cache,
            cache[0],
            cache[1],
            attn.slot_mapping,
            c.num_attention_heads,
            c.num_key_value_heads,
        )
        args = (q, cache[0], cache[1], attn.cu_seqlens_q, attn.seq_lens, attn.block_tables)
        if window is None:
            o = ops.unified_attention(*args, self.scale)  # [T, Hq, D]
        else:
            o = ops.unified_attention(*args, self.scale, sliding_window=window)
        return quant.linear(o.reshape(-1, self.q_size), layer.o_proj)

    def _logits(self, x, residual, logits_indices, ops, hidden_indices=None):
        """The final norm and LM head over the rows that emit a token: [N, V] fp32; with
        `hidden_indices` also the final-norm rows [M, H] fp32 (embeddings; no LM head)."""
        rows = logits_indices if hidden_indices is None else torch.cat(
            [logits_indices, hidden_indices]
        )  # fmt: skip
        x = x.index_select(0, rows)
        residual = residual.index_select(0, rows)
        h, _ = ops.rms_norm(x, self.norm, self.config.rms_norm_eps, residual)
        if hidden_indices is None:
            return quant.linear(h, self.lm_head).float()  # [N, V]
        n = logits_indices.shape[0]
        return quant.linear(h[:n], self.lm_head).float(), h[n:].float()
