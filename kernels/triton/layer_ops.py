"""Triton fused layer ops of the Llama block: RMSNorm (+ residual add), RoPE, SiLU-and-mul.

Numerics mirror transformers' Llama modules (see :mod:`laneserve.kernels.reference`): where transformers
computes in the activation dtype, intermediate products are rounded to that dtype here too
(``ROUND`` below), so bf16 results agree with the reference to the last bit in most elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laneserve.kernels.triton._common import check_device, check_last_dim_contiguous
from laneserve.kernels.triton._common import round_to as _round


# --------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    new_residual_ptr,  # [num_rows, hidden] (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)  # the decoder layer adds in the activation dtype
        tl.store(new_residual_ptr + row * stride_nr + cols, _round(x, dtype).to(dtype), mask=mask)
    variance = tl.sum(x * x, axis=0) / hidden
    h = _round(x * tl.rsqrt(variance + eps), dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _round(w * h, dtype).to(dtype), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    check_device(name, t)
    check_last_dim_contiguous(name, t)
    return t.reshape(-1, t.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`laneserve.kernels.reference.rms_norm` (same shapes, returns and numerics).

    Raises:
        ValueError: a tensor is not on a usable device or not contiguous in its last dimension.
    """
    x2 = _rows("x", x)
    check_device("weight", weight)
    weight = weight.contiguous()
    hidden = x2.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows("residual", residual)
        new_residual = torch.empty_like(out)
        nr2 = new_residual.view(-1, hidden)
    else:
        r2, nr2 = x2, out2
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            nr2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            nr2.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    if residual is not None:
        return out, new_residual
    return out


# ------------------------------------------------------------------------------------------ RoPE
@triton.jit
def _rotate_heads(
    x_ptr,
    row,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """In place: x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin for every head of token ``row``."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    p1 = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    p2 = p1 + HALF
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    c = _round(cos, dtype)[None, :]
    s = _round(sin, dtype)[None, :]
    # transformers: q * cos + rotate_half(q) * sin, each product rounded to the dtype
    o1 = _round(x1 * c, dtype) - _round(x2 * s, dtype)
    o2 = _round(x2 * c, dtype) + _round(x1 * s, dtype)
    tl.store(p1, _round(o1, dtype).to(dtype), mask=mask)
    tl.store(p2, _round(o2, dtype).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_pos, rot_dim]
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,  # rot_dim // 2
    HALF_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_ok, other=0.0).to(
        tl.float32
    )
    _rotate_heads(
        q_ptr, row, stride_q_t, stride_q_h, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD
    )
    _rotate_heads(
        k_ptr, row, stride_k_t, stride_k_h, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`laneserve.kernels.reference.rotary_embedding` (in place; returns ``(q, k)``).

    Positions must be ``< max_pos`` (not checked on the device).

    Raises:
        ValueError: a tensor is not on a usable device or not contiguous where required.
    """
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache), ("positions", positions)):
        check_device(name, t)
        check_last_dim_contiguous(name, t)
    num_tokens = positions.shape[0]
    half = cos_sin_cache.shape[1] // 2
    if num_tokens == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1],
        NUM_KV_HEADS=k.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
    )
    return q, k


# ----------------------------------------------------------------------------------- SiLU-and-mul
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * inter]
    out_ptr,  # [num_rows, inter]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_o + cols, _round(act * up, dtype).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`laneserve.kernels.reference.silu_and_mul`: ``[..., 2I] -> [..., I]``.

    Raises:
        ValueError: ``x`` is not on a usable device or not contiguous in its last dimension.
    """
    x2 = _rows("x", x)
    inter = x2.shape[1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block
        )
    return out
