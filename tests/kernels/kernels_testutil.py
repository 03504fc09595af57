"""Input builders and a naive dense attention oracle for the kernel tests."""

from __future__ import annotations

import torch


def make_paged_batch(
    pairs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str = "cpu",
    num_blocks: int | None = None,
    use_last_blocks: bool = False,
) -> dict:
    """Build ``unified_attention`` inputs for sequences given as ``(query_len, kv_len)`` pairs.

    Blocks are drawn at random from the pool (or from its end when ``use_last_blocks``); unused
    block-table entries are -1 so a kernel reading past a sequence's last block would fail loudly.
    """
    blocks_per_seq = [-(-kv_len // block_size) for _, kv_len in pairs]
    total = sum(blocks_per_seq)
    num_blocks = num_blocks or total + 7
    if use_last_blocks:
        pool = torch.arange(num_blocks - total, num_blocks).flip(0)
    else:
        pool = torch.randperm(num_blocks, generator=gen)[:total]
    block_tables = torch.full((len(pairs), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = pool[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    query_lens = [q for q, _ in pairs]
    args = {
        "q": torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen).to(dtype),
        "k_cache": torch.randn(shape, generator=gen).to(dtype),
        "v_cache": torch.randn(shape, generator=gen).to(dtype),
        "cu_seqlens_q": torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int(),
        "seq_lens": torch.tensor([kv for _, kv in pairs], dtype=torch.int32),
        "block_tables": block_tables,
        "softmax_scale": head_dim**-0.5,
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def naive_attention(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, softmax_scale, sliding_window=None
) -> torch.Tensor:
    """Dense fp32 attention, token by token from the block table: the oracle for both backends.

    With ``sliding_window`` W a query at position i sees keys i - W < j <= i."""
    q, k_cache, v_cache = q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        q_len = hi - lo
        blocks = [int(block_tables[s, p // block_size]) for p in range(ctx)]
        k = torch.stack([k_cache[b, p % block_size] for p, b in enumerate(blocks)])  # [ctx, Hk, D]
        v = torch.stack([v_cache[b, p % block_size] for p, b in enumerate(blocks)])
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], k) * softmax_scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
