"""Sparse mixture-of-experts ops: top-k softmax routing and the routed experts' SwiGLU MLPs.

``fused_moe`` dispatches like the other kernels (:func:`laneserve.kernels.backend_for`): the Triton
grouped GEMM (:mod:`laneserve.kernels.triton.fused_moe`) for CUDA tensors or a forced ``triton``
backend, else :func:`fused_moe_reference`, the plain PyTorch version the tests compare it with.
Both group the (token, expert) pairs by expert so that each expert's weights are read once per
call (:func:`grouped_experts`, which the model also runs over quantized per-expert linears).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["route", "grouped_experts", "fused_moe", "fused_moe_reference", "silu_and_mul_ref"]


def route(
    h: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, as transformers' Mixtral / Qwen3-MoE routers compute it.

    ``h [T, H]`` and the router ``gate [E, H]`` give logits in the activation dtype, a float32
    softmax over all experts, then ``torch.topk`` (so ties go to the lower expert index, as in
    transformers) and, with ``renormalize``, the top-k weights divided by their sum.
    Returns ``(topk_weights float32 [T, k], topk_ids int64 [T, k])``.
    """
    probs = torch.softmax(F.linear(h, gate), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert(topk_ids[t, k], x[t])`` for every row ``t`` of ``x [T, H]``.

    The T*k (token, expert) pairs are sorted by expert; each active expert runs once over all of
    its rows (``expert(e, rows [n, H]) -> [n, H]``: one GEMM per weight, not one GEMV per token),
    and its weighted output is scatter-added to the rows' tokens in ascending expert order
    (transformers' order of summation).
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        y = expert(e, x.index_select(0, rows))
        out.index_add_(0, rows, (y * weights[start : start + n, None]).to(out.dtype))
        start += n
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2I] -> [..., I]``: silu(gate) * up, in the activation dtype as transformers does."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs over dense stacked weights, in plain PyTorch.

    x ``[T, H]``; w13 ``[E, 2I, H]`` = cat(gate, up) per expert; w2 ``[E, H, I]``; topk_weights
    float32 ``[T, k]``; topk_ids int64 ``[T, k]``. Returns ``[T, H]`` in x's dtype.
    """

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul_ref(F.linear(rows, w13[e])), w2[e])

    return grouped_experts(x, topk_weights, topk_ids, w13.shape[0], expert)


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    """Raise ``ValueError`` / ``TypeError`` on shapes or dtypes `fused_moe` cannot take."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused_moe: x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    e, two_i, h = w13.shape
    if two_i % 2 or x.shape[1] != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x "
            f"{tuple(x.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k]"
        )
    if topk_ids.dtype != torch.int64 or not (x.dtype == w13.dtype == w2.dtype):
        raise TypeError(
            f"fused_moe: topk_ids must be int64 and x, w13, w2 one dtype; got {topk_ids.dtype}, "
            f"{x.dtype}, {w13.dtype}, {w2.dtype}"
        )
    capturing = topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()  # no host sync
    if (
        topk_ids.numel()
        and not capturing
        and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < e
    ):
        raise ValueError(f"fused_moe: topk_ids out of range [0, {e})")


def fused_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The routed experts' MLPs (see :func:`fused_moe_reference` for shapes): Triton's grouped
    GEMM where :func:`laneserve.kernels.backend_for` says ``triton``, the reference otherwise.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or expert ids (the message says which).
    """
    from laneserve import kernels

    _check(x, w13, w2, topk_weights, topk_ids)
    if kernels.backend_for(x) == "triton":
        kernels._impl(x)  # sets TRITON_INTERPRET for CPU tensors before the first Triton import
        from laneserve.kernels.triton.fused_moe import fused_moe as triton_fused_moe

        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
