"""Triton fused MoE: the routed experts' SwiGLU MLPs as two grouped GEMMs over sorted token ids.

As vLLM's ``fused_moe`` does: the T*k (token, expert) pairs are sorted by expert and each expert's
run padded to a multiple of ``BLOCK_M`` (:func:`align_block_size`), so every ``BLOCK_M`` rows of the
sorted list belong to one expert. One program computes a ``BLOCK_M x BLOCK_N`` tile of
``A[rows] @ W[expert].T``, reading the rows of A by their token id and that expert's weight tile;
the first GEMM writes ``[T*k, 2I]`` (gate and up), SiLU-and-mul gives ``[T*k, I]``, the second GEMM
multiplies by the routing weight and writes ``[T*k, H]``, summed over k. Accumulation is float32.
The plain-PyTorch reference is :func:`laneserve.kernels.moe.fused_moe_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laneserve.kernels.triton._common import INTERPRET, check_device
from laneserve.kernels.triton.layer_ops import silu_and_mul

BLOCK_M = 16  # rows of sorted pairs per program (one expert's): decode batches are short
# output and reduction tiles: GPU-sized when compiled, the interpreter's minimum for tl.dot on CPU
BLOCK_N, BLOCK_K = (32, 32) if INTERPRET else (64, 64)


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted (token, expert) pair ids padded per expert to ``block_m``, and each block's expert,
    with no host sync (CUDA-graph safe: sizes depend on the shapes only).

    Returns ``sorted_ids int32 [P]`` (flat pair ids ``t * k + j`` grouped by expert, stable;
    padding entries equal ``T * k``), ``expert_ids int32 [P / block_m]`` (``num_experts`` for the
    blocks past the padded total) and that total ``int32 [1]``. ``P`` is the bound
    ``(ceil(T * k / block_m) + min(E, T * k)) * block_m``.
    """
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    rank = torch.arange(num_pairs, device=device) - first[by_expert]
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[ends[by_expert] - padded[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: one row per token (A_PER_PAIR=False) or per pair
    w_ptr,  # [E, N, K]
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # float32 [num_pairs] routing weights (read with MUL_WEIGHT)
    sorted_ids_ptr,  # int32 [P]
    expert_ids_ptr,  # int32 [P / BLOCK_M]
    total_ptr,  # int32 [1]: rows of sorted_ids in use (the rest are padding blocks)
    N,
    K,
    num_pairs,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_PER_PAIR: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP32_DOT: tl.constexpr,  # cast tiles to fp32 before tl.dot (the interpreter lacks bf16 dot)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    if A_PER_PAIR:
        a_rows = pairs.to(tl.int64)
    else:
        a_rows = (pairs // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + kk[None, :],
            mask=valid[:, None] & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + kk[:, None],
            mask=(offs_n[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] = W[expert, n, k] transposed
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif a.dtype == tl.float32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a, w, out, weights, routing, top_k, a_per_pair, mul_weight):
    sorted_ids, expert_ids, total = routing
    n, k = w.shape[1], w.shape[2]
    grid = (expert_ids.shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        weights,
        sorted_ids,
        expert_ids,
        total,
        n,
        k,
        out.shape[0],
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_PER_PAIR=a_per_pair,
        MUL_WEIGHT=mul_weight,
        FP32_DOT=INTERPRET,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def fused_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """x ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, topk_weights float32 ``[T, k]``,
    topk_ids int64 ``[T, k]`` -> ``[T, H]`` (checked by :func:`laneserve.kernels.moe.fused_moe`).

    Raises:
        ValueError: tensors on a device this process's Triton kernels cannot run on.
    """
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_ids", topk_ids)):
        check_device(name, t)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    routing = align_block_size(topk_ids, w13.shape[0], BLOCK_M)
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, routing, top_k, False, False)
    act = silu_and_mul(gate_up)  # [T*k, I]
    down = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, weights, routing, 1, True, True)
    return down.view(num_tokens, top_k, -1).sum(dim=1)


def compile_cases():
    """(name, kernel, signature, constexprs) of every variant `fused_moe` launches, in
    `kernels.triton.compile_check`'s form, for compiling ahead of time without a GPU."""
    for dt in ("bf16", "fp32"):
        for per_pair in (False, True):  # the gate/up GEMM, then the weighted down GEMM
            sig = {"a_ptr": f"*{dt}", "w_ptr": f"*{dt}", "c_ptr": f"*{dt}", "weights_ptr": "*fp32"}
            sig |= dict.fromkeys(("sorted_ids_ptr", "expert_ids_ptr", "total_ptr"), "*i32")
            sig |= dict.fromkeys(("N", "K", "num_pairs", "top_k"), "i32")
            sig |= dict.fromkeys(("stride_am", "stride_we", "stride_wn", "stride_cm"), "i32")
            consts = dict(A_PER_PAIR=per_pair, MUL_WEIGHT=per_pair, FP32_DOT=False)
            consts |= dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
            yield f"fused_moe[{dt},down={per_pair}]", _grouped_gemm_kernel, sig, consts
