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
    first_block: int = 0,
) -> torch.Tensor:
    """Return tokens ``[first_block * block_size, length)`` addressed by ``block_table`` as
    ``[..., length - first_block * block_size, Hk, D]`` (blocks before ``first_block`` unread)."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    n_blocks = -(-length // block_size) - first_block
    # Entries past a sequence's last block may hold anything (e.g. -1 or stale ids); clamp so the
    # gather stays in bounds. Those tokens are masked out by the caller.
    idx = block_table[..., first_block : first_block + n_blocks].long().clamp(0, num_blocks - 1)
    kv = cache.index_select(0, idx.flatten())  # faster than cache[idx] on CPU
    kv = kv.view(*idx.shape[:-1], n_blocks * block_size, *cache.shape[2:])  # [..., n*bs, Hk, D]
    return kv[..., : length - first_block * block_size, :, :]


def _first_block(first_query_pos: int, window: int, block_size: int) -> int:
    """The first block holding a key that a query at ``first_query_pos`` or later can see: 0
    without a window (``window == 0``), else the block of key ``first_query_pos - window + 1``.
    The blocks before it lie wholly outside every such query's window and are not read."""
    return max(0, first_query_pos - window + 1) // block_size if window else 0


def _window_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each row's block table from its first block inside the window, for a batch of one-token
    rows: ``(tables [B, n] with n covering the longest row's window, the first key position of
    each row's table [B] int64, n * block_size)``. Entries past a row's blocks repeat its first."""
    lens = seq_lens.to(block_tables.device, torch.long)
    first = (lens - window).clamp(min=0) // block_size  # [B]
    n = -(-min(max_len, window + block_size - 1) // block_size)  # a window spans at most this many
    cols = first[:, None] + torch.arange(n, device=block_tables.device)[None, :]  # [B, n]
    cols = torch.where(cols < block_tables.shape[1], cols, first[:, None])
    return block_tables.gather(1, cols), first * block_size, n * block_size


def _decode_attention(
    q: torch.Tensor,  # [B, Hq, D] (one query token per sequence)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32
    seq_lens_list: list[int],
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    softmax_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Batched decode: gather every sequence padded to the longest one and mask by length.

    The KV stays in the cache dtype (no fp32 copy of the whole context) and the ``g = Hq / Hk``
    query heads that share a KV head become ``g`` query rows of one SDPA problem per KV head, so
    no KV is repeated for GQA. For bf16/fp16 input PyTorch's CPU SDPA accumulates in fp32; its
    intermediate rounding may differ slightly from the Triton kernel's (both are checked against a
    dense fp32 oracle within bf16 tolerance, tests/kernels). With a sliding ``window`` (> 0) each
    row gathers only the blocks from its window's first one (:func:`_window_tables`) and sees its
    last ``window`` keys. Returns ``[B, Hq, D]`` in the cache dtype.
    """
    max_len = max(seq_lens_list)
    lens = seq_lens.to(q.device, torch.long)[:, None]  # [B, 1]
    if window:
        tables, key0, span = _window_tables(
            block_tables, seq_lens, max_len, window, k_cache.shape[1]
        )
        k = _gather_kv(k_cache, tables, span)  # [B, span, Hk, D]
        v = _gather_kv(v_cache, tables, span)
        positions = key0.to(q.device)[:, None] + torch.arange(span, device=q.device)  # [B, span]
        valid = (positions < lens) & (positions >= lens - window)
    else:
        k = _gather_kv(k_cache, block_tables, max_len)  # [B, L, Hk, D]
        v = _gather_kv(v_cache, block_tables, max_len)
        positions = torch.arange(max_len, device=q.device)[None, :]
        valid = None if min(seq_lens_list) == max_len else positions < lens  # [B, L]
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    # query head h reads KV head h // g, so heads kv*g .. kv*g+g-1 form KV head kv's group
    q_grouped = q.to(k.dtype).reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q_grouped,  # [B, Hk, g, D]
        k.transpose(1, 2),  # [B, Hk, L, D]
        v.transpose(1, 2),
        attn_mask=None if valid is None else valid[:, None, None, :],  # [B, 1, 1, L]
        scale=softmax_scale,
    )  # [B, Hk, g, D]
    return out.reshape(batch, num_q_heads, head_dim)


def _sequence_attention(
    q: torch.Tensor,  # [q_len, Hq, D]
    k: torch.Tensor,  # [n_keys, Hk, D] fp32: keys ctx - n_keys .. ctx - 1
    v: torch.Tensor,  # [n_keys, Hk, D] fp32
    softmax_scale: float,
    ctx: int,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of one sequence's query tokens (the last ``q_len`` of its ``ctx`` tokens)
    over the last ``n_keys`` keys of its context; with a ``window`` (> 0) a query at position i
    sees keys i - window < j <= i."""
    q_len, n_keys = q.shape[0], k.shape[0]
    mask = None
    is_causal = False
    if q_len == n_keys == ctx and not window:
        is_causal = (
            q_len > 1
        )  # SDPA's top-left causal mask equals ours: the query spans the context
    elif q_len > 1 or window:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(ctx - n_keys, ctx, device=q.device)[None, :]  # [1, n_keys]
        mask = k_pos <= q_pos  # [q_len, n_keys]
        if window:
            mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),  # [1, Hq, q_len, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, Hk, n_keys, D]
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


def _grouped_decode(q, kv, seq_lens, seq_lens_list, block_tables, scale, window, out, groups):
    """A pure decode batch on the PyTorch path, in the length ``groups`` of
    :func:`_length_groups_tensors` (None: one group); ``kv`` = (k_cache, v_cache)."""
    if groups is None:
        res = _decode_attention(q, *kv, seq_lens, seq_lens_list, block_tables, scale, window)
        return out.copy_(res)
    for rows, rows_list in groups:
        out[rows] = _decode_attention(
            q.index_select(0, rows),
            *kv,
            seq_lens.index_select(0, rows),
            [seq_lens_list[r] for r in rows_list],
            block_tables.index_select(0, rows),
            scale,
            window,
        ).to(out.dtype)
    return out


def _mixed_decodes(
    q, k_cache, v_cache, seq_lens, layout, block_tables, softmax_scale, window, out, in_place
) -> set[int]:
    """The one-token rows of a mixed batch, all in one call (the C++ decode kernel when
    ``in_place``, else the batched PyTorch path for 2+ rows); returns the sequences done."""
    seq_lens_list, starts, decodes = layout
    if not decodes or (len(decodes) == 1 and not in_place):
        return set()
    n = len(decodes)
    if in_place and decodes[-1] == n - 1:
        # the scheduler's usual order: the decodes are the batch's first sequences and rows, so
        # their query rows, lengths and tables are views (no per-layer index tensors, gathers
        # or scatter: ~10 small ops a layer of a mixed step)
        res = torch.ops.laneserve.paged_decode_attention(
            q[:n],
            k_cache,
            v_cache,
            _int32(seq_lens[:n]),
            _int32(block_tables[:n]),
            softmax_scale,
            window,
        )
        out[:n].copy_(res)
        return set(decodes)
    seq_idx = torch.tensor(decodes, device=q.device)
    rows = torch.tensor([starts[s] for s in decodes], device=q.device)
    if in_place:
        res = torch.ops.laneserve.paged_decode_attention(
            q[rows],
            k_cache,
            v_cache,
            _int32(seq_lens[seq_idx]),
            _int32(block_tables[seq_idx]),
            softmax_scale,
            window,
        )
    else:
        res = _decode_attention(
            q[rows],
            k_cache,
            v_cache,
            seq_lens[seq_idx],
            [seq_lens_list[s] for s in decodes],
            block_tables[seq_idx],
            softmax_scale,
            window,
        )
    out[rows] = res.to(out.dtype)
    return set(decodes)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
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
        sliding_window: ``None`` (full causal attention) or ``W >= 1``: a query at absolute
            position ``i`` attends keys ``j`` with ``i - W < j <= i`` (transformers' and vLLM's
            ``sliding_window``, as Mistral and Gemma 3's local layers use it). Blocks wholly
            before every query's window are not read, so their table entries may be stale.

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
    layout = _layout_memo.get(
        seq_lens, (cu_seqlens_q, _version(cu_seqlens_q)), lambda: _layout(seq_lens, cu_seqlens_q)
    )
    seq_lens_list, starts, decodes = layout
    window = sliding_window or 0  # 0: no window, as the C++ ops take it
    num_seqs = len(seq_lens_list)
    cpp = _cpp_attention(q, k_cache, v_cache)  # the C++ kernels take these tensors
    in_place = bool(decodes) and cpp
    if len(decodes) == num_seqs == num_tokens and in_place:  # pure decode: blocks read in place
        res = torch.ops.laneserve.paged_decode_attention(
            q, k_cache, v_cache, _int32(seq_lens), _int32(block_tables), softmax_scale, window
        )
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty_like(q)
    if len(decodes) == num_seqs == num_tokens:  # pure decode batch
        groups = _groups_memo.get(
            seq_lens, (cu_seqlens_q,), lambda: _length_groups_tensors(seq_lens_list, q.device)
        )
        kv = (k_cache, v_cache)
        return _grouped_decode(
            q, kv, seq_lens, seq_lens_list, block_tables, softmax_scale, window, out, groups
        )
    decodes_done = _mixed_decodes(
        q, k_cache, v_cache, seq_lens, layout, block_tables, softmax_scale, window, out, in_place
    )
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
            window,
        )
        return out
    block_size = k_cache.shape[1]
    for s in range(num_seqs):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo or s in decodes_done:
            continue
        ctx = seq_lens_list[s]
        first = _first_block(ctx - (hi - lo), window, block_size)
        k = _gather_kv(k_cache, block_tables[s], ctx, first).float()  # [n_keys, Hk, D]
        v = _gather_kv(v_cache, block_tables[s], ctx, first).float()
        out[lo:hi] = _sequence_attention(q[lo:hi], k, v, softmax_scale, ctx, window)
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
