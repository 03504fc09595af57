"""Argument checks shared by both backends: wrong shapes, dtypes or devices raise a clear error.

Errors: ``TypeError`` for a wrong dtype or a non-tensor, ``ValueError`` for a wrong shape, size,
device or layout. Each message names the offending argument. The checks read only tensor metadata
(no device synchronisation).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, t: object, ndim: int | None = None, dtypes: tuple = ()) -> torch.Tensor:
    """Check that ``t`` is a tensor with ``ndim`` dimensions and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    return t


def same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def sliding_window_arg(sliding_window) -> None:
    """``None`` or a positive int (tokens a query sees, itself included)."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")


def attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, softmax_scale, out):
    tensor("q", q, 3, FLOAT_DTYPES)
    tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES)
    tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have {num_seqs} rows, got {block_tables.shape[0]}")
    if not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if out is not None:
        tensor("out", out, 3)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must match q ({tuple(q.shape)}, {q.dtype}), got ({tuple(out.shape)}, {out.dtype})"
            )
    extra = {"out": out} if out is not None else {}
    same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        **extra,
    )


def cache_args(key, value, k_cache, v_cache, slot_mapping):
    tensor("key", key, 3, FLOAT_DTYPES)
    tensor("value", value, 3, FLOAT_DTYPES)
    tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key [num_tokens, num_kv_heads, head_dim] = {tuple(key.shape)} does not match "
            f"k_cache [num_blocks, block_size, num_kv_heads, head_dim] = {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def rms_norm_args(x, weight, eps, residual):
    tensor("x", x, None, FLOAT_DTYPES)
    tensor("weight", weight, 1, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"x last dim {tuple(x.shape)[-1:]} must equal weight size {weight.shape[0]}"
        )
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if residual is not None:
        tensor("residual", residual, None, FLOAT_DTYPES)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        same_device(x=x, weight=weight, residual=residual)
    else:
        same_device(x=x, weight=weight)


def rotary_args(positions, q, k, cos_sin_cache):
    tensor("positions", positions, 1, INDEX_DTYPES)
    tensor("q", q, 3, FLOAT_DTYPES)
    tensor("k", k, 3, FLOAT_DTYPES)
    tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    num_tokens = positions.shape[0]
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must have {num_tokens} tokens (positions)"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > q.shape[2] or rot_dim == 0:
        raise ValueError(f"cos_sin_cache width {rot_dim} must be even and <= head_dim {q.shape[2]}")
    same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)


def silu_and_mul_args(x):
    tensor("x", x, None, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x last dim must be even ([..., 2 * intermediate]), got {tuple(x.shape)}")


def rope_and_cache_args(qkv, num_q_heads, num_kv_heads, head_dim):
    tensor("qkv", qkv, 2, FLOAT_DTYPES)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv [T, (Hq + 2 Hk) * D] must be {width} wide for Hq={num_q_heads}, "
            f"Hk={num_kv_heads}, D={head_dim}; got {tuple(qkv.shape)}"
        )
