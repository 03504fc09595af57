"""Plain-PyTorch reference of every laneserve kernel (the CPU path, and the oracle for the Triton tests).

Shapes follow docs/interfaces.md. All functions accept float32, float16 and bfloat16 activations.
Attention accumulates in fp32 and returns the input dtype; the layer ops reproduce the numerics of
Hugging Face's Llama modules (``LlamaRMSNorm``, ``apply_rotary_pos_emb``, ``LlamaMLP``) so a model built on
them matches ``transformers`` token for token in float32.

Validation of shapes/dtypes lives in :mod:`laneserve.kernels._validate` and is done by the dispatcher in
``kernels/__init__.py``; these functions assume valid input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from laneserve.kernels import cpu_ext

__all__ = [
    "unified_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]


class _StepMemo:
    """One-entry cache of a value derived from a per-step tensor (positions, seq_lens, ...).

    Every layer of a forward passes the same metadata tensors; what this derives from them (RoPE
    cos/sin rows, decode length groups) is computed by the first layer and reused by the rest. The
    entry holds the tensor (so its id cannot be reused) and is keyed on its in-place version
    counter and on ``extra`` (tensors in it compared by identity), so a tensor refilled in place
    never returns a stale value. Inference-mode tensors have no version counter: they are never
    memoized. The entry is one tuple, replaced in a single assignment (safe across threads).
    """

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple | None = None  # (tensor, version, extra, value)

    def get(self, tensor: torch.Tensor, extra: tuple, compute):
        if tensor.is_inference():
            return compute()
        version = tensor._version
        entry = self.entry
        if (
            entry is not None
            and entry[0] is tensor
            and entry[1] == version
            and len(entry[2]) == len(extra)
            and all(
                a is b or (not torch.is_tensor(a) and a == b)
                for a, b in zip(entry[2], extra, strict=True)
            )
        ):
            return entry[3]
        value = compute()
        self.entry = (tensor, version, extra, value)
        return value


_rope_memo = _StepMemo()
_groups_memo = _StepMemo()
_layout_memo = _StepMemo()  # host-side lists of the batch layout, read once per step

# Decode sequences are padded to the longest one in their group; grouping by length (up to this
# many groups) pays off once padding would waste more than a fifth of the gathered context.
_MAX_DECODE_GROUPS = 4
_MIN_GROUPING_GAIN = 0.2


def _decode_groups(seq_lens_list: list[int]) -> list[list[int]] | None:
    """Split decode rows into length-sorted groups when that cuts the padded KV by >= 20 %.

    Returns None (one group: all rows) otherwise. Groups hold row indices in ascending length.
    """
    n = len(seq_lens_list)
    if n < 2 * _MAX_DECODE_GROUPS:
        return None
    order = sorted(range(n), key=seq_lens_list.__getitem__)
    size = -(-n // _MAX_DECODE_GROUPS)
    groups = [order[i : i + size] for i in range(0, n, size)]
    padded_one = n * seq_lens_list[order[-1]]
    padded_grouped = sum(len(g) * seq_lens_list[g[-1]] for g in groups)
    if padded_grouped > (1 - _MIN_GROUPING_GAIN) * padded_one:
        return None
    return groups


def _length_groups_tensors(seq_lens_list: list[int], device) -> list | None:
    """:func:`_decode_groups` as ``(row index tensor, row list)`` pairs, or None."""
    groups = _decode_groups(seq_lens_list)
    if groups is None:
        return None
    return [(torch.tensor(g, device=device), g) for g in groups]


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [..., n_blocks] int32
    length: int,
) -> torch.Tensor:
    """Return the first ``length`` tokens addressed by ``block_table`` as ``[..., length, Hk, D]``."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    n_blocks = -(-length // block_size)
    # Entries past a sequence's last block may hold anything (e.g. -1 or stale ids); clamp so the
    # gather stays in bounds. Those tokens are masked out by the caller.
    idx = block_table[..., :n_blocks].long().clamp(0, num_blocks - 1)
    kv = cache.index_select(0, idx.flatten())  # faster than cache[idx] on CPU
    kv = kv.view(*idx.shape[:-1], n_blocks * block_size, *cache.shape[2:])  # [..., n*bs, Hk, D]
    return kv[..., :length, :, :]


def _decode_attention(
    q: torch.Tensor,  # [B, Hq, D] (one query token per sequence)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32
    seq_lens_list: list[int],
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    softmax_scale: float,
) -> torch.Tensor:
    """Batched decode: gather every sequence padded to the longest one and mask by length.

    The KV stays in the cache dtype (no fp32 copy of the whole context) and the ``g = Hq / Hk``
    query heads that share a KV head become ``g`` query rows of one SDPA problem per KV head, so
    no KV is repeated for GQA. For bf16/fp16 input PyTorch's CPU SDPA accumulates in fp32; its
    intermediate rounding may differ slightly from the Triton kernel's (both are checked against a
    dense fp32 oracle within bf16 tolerance, tests/kernels). Returns ``[B, Hq, D]`` in the cache
    dtype.
    """
    max_len = max(seq_lens_list)
    k = _gather_kv(k_cache, block_tables, max_len)  # [B, L, Hk, D]
    v = _gather_kv(v_cache, block_tables, max_len)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    # query head h reads KV head h // g, so heads kv*g .. kv*g+g-1 form KV head kv's group
    q_grouped = q.to(k.dtype).reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    mask = None
    if min(seq_lens_list) != max_len:
        positions = torch.arange(max_len, device=q.device)
        valid = positions[None, :] < seq_lens.to(q.device, torch.long)[:, None]  # [B, L]
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q_grouped,  # [B, Hk, g, D]
        k.transpose(1, 2),  # [B, Hk, L, D]
        v.transpose(1, 2),
        attn_mask=mask,
        scale=softmax_scale,
    )  # [B, Hk, g, D]
    return out.reshape(batch, num_q_heads, head_dim)


def _sequence_attention(
    q: torch.Tensor,  # [q_len, Hq, D]
    k: torch.Tensor,  # [ctx, Hk, D] fp32
    v: torch.Tensor,  # [ctx, Hk, D] fp32
    softmax_scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's query tokens over its context (queries are the last tokens)."""
    q_len, ctx = q.shape[0], k.shape[0]
    mask = None
    is_causal = False
    if q_len > 1:
        if q_len == ctx:
            is_causal = (
                True  # SDPA's top-left causal mask equals ours when the query spans the context
            )
        else:
            # query i sits at position ctx - q_len + i and sees keys 0..that position
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),  # [1, Hq, q_len, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, Hk, ctx, D]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [1, Hq, q_len, D]
    return out[0].transpose(0, 1)  # [q_len, Hq, D]


def _version(t: torch.Tensor) -> object:
    """``t``'s in-place version, or a fresh object (never equal) for an inference tensor."""
    return object() if t.is_inference() else t._version


def _layout(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> tuple:
    """``(seq_lens list, cu_seqlens_q list, indices of the sequences with one query token)``."""
    seq_lens_list = seq_lens.tolist()
    starts = cu_seqlens_q.tolist()
    decodes = [s for s in range(len(seq_lens_list)) if starts[s + 1] - starts[s] == 1]
    return seq_lens_list, starts, decodes


def _cpp_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C++ attention kernels (:mod:`laneserve.kernels.cpu_ext`: decode rows, and the rows of
    sequences with several query tokens) can take these tensors."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
        and cpu_ext.load()
    )


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.stride(-1) == 1:
        return t
    return t.to(torch.int32).contiguous()


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a flattened varlen batch of decode tokens and prefill chunks.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``; sequence ``s`` owns rows
            ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding this
            step's keys/values (see :func:`reshape_and_cache`).
        cu_seqlens_q: int32 ``[num_seqs + 1]``, cumulative query lengths starting at 0.
        seq_lens: int32 ``[num_seqs]``, context length including this step's query tokens.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, physical block ids per sequence.
        softmax_scale: multiplier of ``q @ k^T`` (usually ``head_dim ** -0.5``).
        out: optional ``[num_tokens, num_q_heads, head_dim]`` tensor written in place.

    Query token ``i`` of sequence ``s`` sits at position ``seq_lens[s] - q_len_s + i`` and attends to
    keys ``0..`` that position. GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
    Scores, softmax and the weighted sum accumulate in fp32 (low-precision inputs may round
    intermediates, as flash-attention kernels do); the result has ``q``'s dtype.

    Returns:
        ``out`` (or a new tensor) ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return torch.empty_like(q) if out is None else out
    seq_lens_list, starts, decodes = _layout_memo.get(
        seq_lens, (cu_seqlens_q, _version(cu_seqlens_q)), lambda: _layout(seq_lens, cu_seqlens_q)
    )
    num_seqs = len(seq_lens_list)
    cpp = _cpp_attention(q, k_cache, v_cache)  # the C++ kernels take these tensors
    in_place = bool(decodes) and cpp
    if len(decodes) == num_seqs == num_tokens and in_place:  # pure decode: blocks read in place
        res = torch.ops.laneserve.paged_decode_attention(
            q, k_cache, v_cache, _int32(seq_lens), _int32(block_tables), softmax_scale
        )
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty_like(q)
    if len(decodes) == num_seqs == num_tokens:  # pure decode batch
        groups = _groups_memo.get(
            seq_lens, (cu_seqlens_q,), lambda: _length_groups_tensors(seq_lens_list, q.device)
        )
        if groups is None:
            res = _decode_attention(
                q, k_cache, v_cache, seq_lens, seq_lens_list, block_tables, softmax_scale
            )
            out.copy_(res)
            return out
        for rows, rows_list in groups:
            out[rows] = _decode_attention(
                q.index_select(0, rows),
                k_cache,
                v_cache,
                seq_lens.index_select(0, rows),
                [seq_lens_list[r] for r in rows_list],
                block_tables.index_select(0, rows),
                softmax_scale,
            ).to(out.dtype)
        return out
    if decodes and in_place:  # the decodes of a mixed batch: one kernel call for all of them
        seq_idx = torch.tensor(decodes, device=q.device)
        rows = torch.tensor([starts[s] for s in decodes], device=q.device)
        out[rows] = torch.ops.laneserve.paged_decode_attention(
            q[rows],
            k_cache,
            v_cache,
            _int32(seq_lens[seq_idx]),
            _int32(block_tables[seq_idx]),
            softmax_scale,
        ).to(out.dtype)
        decodes_done = set(decodes)
    elif len(decodes) > 1:  # the decodes of a mixed batch still go through the batched path
        seq_idx = torch.tensor(decodes, device=q.device)
        rows = torch.tensor([starts[s] for s in decodes], device=q.device)
        out[rows] = _decode_attention(
            q[rows],
            k_cache,
            v_cache,
            seq_lens[seq_idx],
            [seq_lens_list[s] for s in decodes],
            block_tables[seq_idx],
            softmax_scale,
        ).to(out.dtype)
        decodes_done = set(decodes)
    else:
        decodes_done = set()
    if cpp and out.dtype == q.dtype and out.stride(-1) == 1:  # sequences of 2+ query tokens
        torch.ops.laneserve.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            _int32(cu_seqlens_q),
            _int32(seq_lens),
            _int32(block_tables),
            softmax_scale,
            out,
        )
        return out
    for s in range(num_seqs):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo or s in decodes_done:
            continue
        ctx = seq_lens_list[s]
        k = _gather_kv(k_cache, block_tables[s], ctx).float()  # [ctx, Hk, D]
        v = _gather_kv(v_cache, block_tables[s], ctx).float()
        out[lo:hi] = _sequence_attention(q[lo:hi], k, v, softmax_scale)
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches in place.

    ``slot_mapping`` int64 ``[num_tokens]``: flat slot ``block * block_size + offset`` of each token;
    negative slots (padding) are skipped. Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    Values are cast to the cache dtype.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    for src, cache in ((key, k_cache), (value, v_cache)):
        if cache.is_contiguous():  # one flat row per slot: index_copy_ beats advanced indexing
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src.to(cache.dtype))
        else:
            cache[slots // block_size, slots % block_size] = src.to(cache.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich, 2019) with an optional fused residual add.

    ``x`` ``[..., hidden]``, ``weight`` ``[hidden]``. Without ``residual`` returns
    ``rmsnorm(x) * weight``; with ``residual`` (same shape as ``x``) returns ``(out, new_residual)``
    where ``new_residual = x + residual`` (in ``x.dtype``, as the Llama decoder layer adds) and
    ``out = rmsnorm(new_residual) * weight``. Numerics follow transformers' ``LlamaRMSNorm``: mean of
    squares and ``rsqrt`` in fp32, normalised value cast back to ``x.dtype`` before the weight multiply.
    The output dtype is ``x.dtype``.
    """
    if residual is not None:
        x = x + residual.to(x.dtype)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    out = weight * h.to(input_dtype)
    if out.dtype != input_dtype:
        out = out.to(input_dtype)
    if residual is not None:
        return out, x
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` rows ``[T, 1, rot_dim]`` in ``dtype`` (each half repeated, rotate-half layout)."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.to(torch.long)]  # [T, rot_dim]
    cos_half, sin_half = cs[:, :half], cs[:, half:]
    cos = torch.cat((cos_half, cos_half), dim=-1).to(dtype)[:, None, :]
    sin = torch.cat((sin_half, sin_half), dim=-1).to(dtype)[:, None, :]
    return cos, sin


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding (RoPE, Su et al. 2021) in place, NeoX/Llama rotate-half layout.

    ``positions`` int ``[T]``; ``q`` ``[T, Hq, D]``; ``k`` ``[T, Hk, D]``; ``cos_sin_cache``
    ``[max_pos, rot_dim]`` = ``cat(cos, sin)`` each ``[max_pos, rot_dim / 2]`` (``rot_dim == D`` for Llama;
    a smaller ``rot_dim`` rotates only the first ``rot_dim`` features). Numerics follow transformers'
    ``apply_rotary_pos_emb``: cos/sin are cast to the tensor's dtype and ``x * cos + rotate_half(x) * sin``
    is computed in that dtype. Returns ``(q, k)``, the same tensors, modified in place.
    """
    rot_dim = cos_sin_cache.shape[-1]
    for x in (q, k):
        cos, sin = _rope_memo.get(
            positions,
            (cos_sin_cache, x.dtype),
            lambda dtype=x.dtype: _cos_sin(positions, cos_sin_cache, dtype),
        )
        x_rot = x[..., :rot_dim]
        x_rot.copy_((x_rot * cos) + (_rotate_half(x_rot) * sin))
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer, 2020): ``[..., 2I] -> [..., I]`` = ``silu(x[..., :I]) * x[..., I:]``.

    Computed in ``x.dtype`` like transformers' ``LlamaMLP`` (``act_fn(gate) * up``).
    """
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]
