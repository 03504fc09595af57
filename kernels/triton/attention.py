"""Unified paged attention in Triton: decode tokens and prefill chunks in one launch.

Algorithm: FlashAttention-2 style online softmax (Dao, 2023) over a paged KV cache (Kwon et al.,
"PagedAttention", 2023), after vLLM's ``triton_unified_attention``: one program handles
``BLOCK_Q`` query tokens of one sequence times the ``num_queries_per_kv`` query heads that share one
KV head, so every K/V tile is read once per GQA group. Programs find their sequence by binary search
over ``cu_seqlens_q`` on the device (no host sync, so the launch can be captured in a CUDA graph).

Grid: ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads, num_segments)``; the ``+ num_seqs``
covers each sequence's partial last q-block, and programs past a sequence's queries return at once.
With ``num_segments > 1`` (split-KV, for decode batches too small to fill the GPU, as vLLM's 3D
launch) each program reads one segment of its sequence's key tiles and stores its unnormalised
accumulator with the running max and sum (fp32); a second kernel combines the segments
(Dao et al., "Flash-Decoding", 2023).

Row ``m`` of a program's tile holds query token ``q_block * BLOCK_Q + m // G`` and query head
``kv_head * G + m % G`` (``G = num_queries_per_kv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laneserve.kernels.triton._common import (
    INTERPRET,
    check_contiguous,
    check_device,
    check_last_dim_contiguous,
    round_to,
)

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(cu_seqlens_q_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``cu_seqlens_q[s] // BLOCK_Q + s <= target`` (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid)
        if start // BLOCK_Q + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    part_acc_ptr,  # split-KV only: fp32 [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_PAD]
    part_ml_ptr,  # split-KV only: fp32 [num_tokens, num_q_heads, NUM_SEGMENTS, 2] (max, sum)
    num_seqs,
    scale_log2,  # softmax_scale * log2(e): scores are kept in base 2
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    G: tl.constexpr,  # num_queries_per_kv
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * G rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per inner iteration
    FP32_DOT: tl.constexpr,  # cast tiles to fp32 before tl.dot (the interpreter lacks bf16 dot)
    IEEE_DOT: tl.constexpr,  # fp32 inputs: full-precision dot instead of TF32
    NUM_SEGMENTS: tl.constexpr,  # 1: write the output; > 1: split-KV partials for the reduce
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq_idx = _find_seq_idx(cu_seqlens_q_ptr, pid_q, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_end = tl.load(cu_seqlens_q_ptr + seq_idx + 1)
    q_len = q_end - q_start
    q_block = pid_q - (q_start // BLOCK_Q + seq_idx)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len  # tokens before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_tok = q_block * BLOCK_Q + offs_m // G  # token index within the sequence's queries
    q_head = kv_head * G + offs_m % G
    row_ok = (offs_m // G < BLOCK_Q) & (q_tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context_len + q_tok  # absolute position of each row's query token

    q_rows = (q_start + q_tok).to(tl.int64)
    q_offs = q_rows[:, None] * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Causal bound: the last query of this program sees keys [0, max_pos].
    last_q = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_q + 1
    num_tiles = tl.cdiv(num_keys, TILE_N)
    tile_lo = 0
    tile_hi = num_tiles
    if NUM_SEGMENTS > 1:  # this program reads only its segment of the context's tiles
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
    bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    offs_n0 = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + offs_n0  # key positions
        n_ok = offs_n < num_keys
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot_offs = (offs_n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_offs = (
            block_ids[:, None] * stride_k_b
            + slot_offs[:, None] * stride_k_s
            + kv_head * stride_k_h
            + offs_d[None, :]
        )
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0)  # [TILE_N, HEAD_PAD]
        if FP32_DOT:
            k = k.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2  # [BLOCK_M, TILE_N], fp32, base-2 logits
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        v_offs = (
            block_ids[:, None] * stride_v_b
            + slot_offs[:, None] * stride_v_s
            + kv_head * stride_v_h
            + offs_d[None, :]
        )
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0)  # [TILE_N, HEAD_PAD]
        if FP32_DOT:
            acc += tl.dot(p, v.to(tl.float32))
        elif IEEE_DOT:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SEGMENTS > 1:
        # Unnormalised partials and their (max, sum) stats; _reduce_segments_kernel combines them.
        row_ok_d = row_ok[:, None] & d_ok[None, :]
        part_rows = (q_rows * (G * tl.num_programs(1)) + q_head) * NUM_SEGMENTS + segment
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok_d)
        tl.store(part_ml_ptr + part_rows * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_rows * 2 + 1, l_i, mask=row_ok)
        return
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    o_offs = q_rows[:, None] * stride_o_t + q_head[:, None] * stride_o_h + offs_d[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(
        out_ptr + o_offs,
        round_to(acc, out_dtype).to(out_dtype),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _reduce_segments_kernel(
    part_acc_ptr,  # fp32 [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_PAD]
    part_ml_ptr,  # fp32 [num_tokens, num_q_heads, NUM_SEGMENTS, 2]
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    num_q_heads,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, with M = max_s m_s (base 2).

    A segment with no visible keys has m_s = -inf and l_s = 0 and contributes nothing.
    """
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token.to(tl.int64) * num_q_heads + head
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_ml_ptr + (row * NUM_SEGMENTS + offs_s) * 2)
    s_sum = tl.load(part_ml_ptr + (row * NUM_SEGMENTS + offs_s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))
    total = tl.sum(s_sum * w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    acc = tl.load(
        part_acc_ptr + (row * NUM_SEGMENTS + offs_s)[:, None] * HEAD_PAD + offs_d[None, :]
    )
    o = tl.sum(acc * w[:, None], axis=0) / total
    out_dtype = out_ptr.dtype.element_ty
    tl.store(
        out_ptr + token.to(tl.int64) * stride_o_t + head * stride_o_h + offs_d,
        round_to(o, out_dtype).to(out_dtype),
        mask=offs_d < HEAD_DIM,
    )


# Split-KV decode (vLLM's "3D" launch): segments per sequence, chosen when a pure-decode grid of
# (sequences x KV heads) programs would leave most of the GPU's SMs idle.
SPLIT_KV_SEGMENTS = 16


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_segments(
    device: torch.device, num_seqs: int, num_kv_heads: int, max_query_len: int | None
) -> int:
    """1 (one pass) unless the batch is pure decode and has fewer (sequence, KV head) programs
    than the GPU has SMs; then :data:`SPLIT_KV_SEGMENTS`. On CPU (interpreter) always 1."""
    if max_query_len != 1:
        return 1
    if num_seqs * num_kv_heads >= _sm_count(device):
        return 1
    return SPLIT_KV_SEGMENTS


def _launch_config(
    num_queries_per_kv: int, max_query_len: int | None, fp32: bool
) -> tuple[int, int, int]:
    """Return ``(BLOCK_M, BLOCK_Q, TILE_N)``; tl.dot needs every dimension >= 16.

    Pure decode uses 16 rows (one token x the GQA group, padded); prefill 64. fp32 tiles use half
    the keys per step so shared memory stays under ~100 KB (sm_86/89).
    """
    block_m = 16 if max_query_len == 1 else 64
    block_m = max(block_m, triton.next_power_of_2(num_queries_per_kv))
    block_q = block_m // num_queries_per_kv
    tile_n = 32 if fp32 or INTERPRET else 64
    return block_m, block_q, tile_n


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    num_segments: int | None = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`laneserve.kernels.reference.unified_attention` (same shapes and semantics).

    ``max_query_len`` (optional, host int) picks a smaller tile for pure-decode batches; when it is
    ``None`` the wrapper guesses it from the shapes without a device sync (``num_tokens ==
    num_seqs``). It is a tiling hint only: results never depend on it.

    Raises:
        TypeError: the KV cache dtype differs from ``q``'s.
        ValueError: a tensor is not on a usable device or not contiguous where required.
    """
    if sliding_window is not None:
        raise NotImplementedError("sliding_window in the Triton kernel")
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache dtype {k_cache.dtype} must equal q dtype {q.dtype} for Triton")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_device(name, t)
        check_last_dim_contiguous(name, t)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        check_contiguous(name, t)
    check_last_dim_contiguous("block_tables", block_tables)
    if out is None:
        out = torch.empty_like(q)
    check_last_dim_contiguous("out", out)

    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        return out
    g = num_q_heads // num_kv_heads
    if max_query_len is None and num_tokens == num_seqs:
        max_query_len = 1
    block_m, block_q, tile_n = _launch_config(g, max_query_len, q.dtype == torch.float32)
    if num_segments is None:
        num_segments = choose_num_segments(q.device, num_seqs, num_kv_heads, max_query_len)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two >= 1, got {num_segments}")
    head_pad = max(16, triton.next_power_of_2(head_dim))
    if num_segments > 1:
        part_acc = torch.empty(
            num_tokens, num_q_heads, num_segments, head_pad, device=q.device, dtype=torch.float32
        )
        part_ml = torch.empty(
            num_tokens, num_q_heads, num_segments, 2, device=q.device, dtype=torch.float32
        )
    else:
        part_acc = part_ml = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _unified_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        part_acc,
        part_ml,
        num_seqs,
        float(softmax_scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        G=g,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        FP32_DOT=INTERPRET,
        IEEE_DOT=q.dtype == torch.float32 and k_cache.dtype == torch.float32,
        NUM_SEGMENTS=num_segments,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_q_heads)](
            part_acc,
            part_ml,
            out,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_segments,
        )
    return out
