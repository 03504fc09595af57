"""A randomly initialised Llama-shaped decoder stack over the paged KV cache, built only from
``kernels`` ops. Used by ``scripts/bench_kernels.py`` (decode step time with/without CUDA graphs)
and by the backend-equivalence test; it is not the engine's model (that lives in gpu_worker).

Layer (Llama, Touvron et al. 2023): ``h = x + o_proj(attn(rope(q), rope(k), v))``,
``out = h + down(silu(gate(h)) * up(h))``, each branch after an RMSNorm; the residual add is fused
into the next RMSNorm (``kernels.rms_norm(x, w, eps, residual)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laneserve import kernels


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Model shape. Defaults are Llama-3-8B's (config.json of meta-llama/Meta-Llama-3-8B)."""

    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_layers: int = 32
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 8192


class PagedLlamaStack:
    """Random weights + a paged KV cache ``[num_layers, 2, num_blocks, block_size, Hk, D]``."""

    def __init__(
        self,
        cfg: StackConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        seed: int = 0,
    ) -> None:
        self.cfg, self.block_size = cfg, block_size
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)

        c = cfg
        qkv_out = (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim
        self.embed = w(c.vocab_size, c.hidden_size) * 50  # embeddings of unit scale
        self.layers = [
            {
                "input_norm": 1 + w(c.hidden_size),
                "qkv": w(qkv_out, c.hidden_size),
                "o": w(c.hidden_size, c.num_q_heads * c.head_dim),
                "post_norm": 1 + w(c.hidden_size),
                "gate_up": w(2 * c.intermediate_size, c.hidden_size),
                "down": w(c.hidden_size, c.intermediate_size),
            }
            for _ in range(c.num_layers)
        ]
        self.final_norm = 1 + w(c.hidden_size)
        self.lm_head = w(c.vocab_size, c.hidden_size)
        inv_freq = 1.0 / c.rope_theta ** (
            torch.arange(0, c.head_dim, 2, device=device).float() / c.head_dim
        )
        freqs = torch.outer(torch.arange(c.max_position, device=device).float(), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, D] fp32
        self.kv_cache = torch.zeros(
            (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim),
            dtype=dtype,
            device=device,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32
        seq_lens: torch.Tensor,  # [B] int32
        block_tables: torch.Tensor,  # [B, max_blocks] int32
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` (fp32) of each sequence's last query token."""
        c = self.cfg
        q_size, kv_size = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = self.embed[input_ids]  # [T, H]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                h, residual = kernels.rms_norm(x, layer["input_norm"], c.rms_norm_eps), x
            else:
                h, residual = kernels.rms_norm(x, layer["input_norm"], c.rms_norm_eps, residual)
            qkv = h @ layer["qkv"].T  # [T, q_size + 2 * kv_size]
            q = qkv[:, :q_size].reshape(-1, c.num_q_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].reshape(-1, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size :].reshape(-1, c.num_kv_heads, c.head_dim)
            q, k = q.contiguous(), k.contiguous()
            kernels.rotary_embedding(positions, q, k, self.cos_sin_cache)
            k_cache, v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            kernels.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
            attn = kernels.unified_attention(
                q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, c.head_dim**-0.5
            )
            x = attn.reshape(-1, q_size) @ layer["o"].T
            h, residual = kernels.rms_norm(x, layer["post_norm"], c.rms_norm_eps, residual)
            x = kernels.silu_and_mul(h @ layer["gate_up"].T) @ layer["down"].T
        h, _ = kernels.rms_norm(x, self.final_norm, c.rms_norm_eps, residual)
        last = cu_seqlens_q[1:].long() - 1
        return (h[last] @ self.lm_head.T).float()

    __call__ = forward


def greedy_generate(
    model: PagedLlamaStack, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy decode ``prompts`` together (one prefill step, then batched decode steps).

    Blocks are handed out contiguously per sequence; the cache must hold every token.
    """
    device = model.kv_cache.device
    bs = model.block_size
    max_len = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_seq = -(-max_len // bs)
    if blocks_per_seq * len(prompts) > model.kv_cache.shape[2]:
        raise ValueError("KV cache too small for these prompts")
    block_tables = torch.arange(blocks_per_seq * len(prompts), dtype=torch.int32, device=device)
    block_tables = block_tables.view(len(prompts), blocks_per_seq)
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    for _ in range(max_new_tokens):
        ids, pos, slots, q_lens = [], [], [], []
        for s, seq in enumerate(seqs):
            new = range(computed[s], len(seq))
            ids += [seq[p] for p in new]
            pos += list(new)
            slots += [(s * blocks_per_seq + p // bs) * bs + p % bs for p in new]
            q_lens.append(len(new))
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        logits = model(
            torch.tensor(ids, device=device),
            torch.tensor(pos, device=device),
            torch.tensor(slots, device=device),
            cu.to(device),
            torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=device),
            block_tables,
        )
        for s, tok in enumerate(logits.argmax(-1).tolist()):
            computed[s] = len(seqs[s])
            seqs[s].append(tok)
    return [seq[len(p) :] for seq, p in zip(seqs, prompts, strict=True)]
