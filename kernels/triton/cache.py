"""Triton ``reshape_and_cache``: scatter this step's keys/values into the paged KV cache.

One program per token; ``slot = block * block_size + offset`` (vLLM's ``reshape_and_cache_flash``
layout, ``[num_blocks, block_size, num_kv_heads, head_dim]``). Negative slots are padding and skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laneserve.kernels.triton._common import (
    check_contiguous,
    check_device,
    check_last_dim_contiguous,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    src = tok * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    dst = block * stride_k_b + offset * stride_k_s + offs_h[:, None] * stride_k_h + offs_d[None, :]
    k = tl.load(key_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    src = tok * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    dst = block * stride_v_b + offset * stride_v_s + offs_h[:, None] * stride_v_h + offs_d[None, :]
    v = tl.load(value_ptr + src, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`laneserve.kernels.reference.reshape_and_cache` (same shapes and semantics).

    Slots must be ``< num_blocks * block_size`` (not checked on the device: that would need a sync).

    Raises:
        ValueError: a tensor is not on a usable device or not contiguous where required.
    """
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_device(name, t)
        check_last_dim_contiguous(name, t)
    check_contiguous("slot_mapping", slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
