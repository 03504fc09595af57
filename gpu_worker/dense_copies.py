"""Dense copies of quantized weights for big calls: when a linear keeps one (`dense_copy_dtype`,
`dense_copies_fit`), from how many rows calls use it (`dense_min_tokens`), and the copy held in
oneDNN's blocked layout (`pack_dense`, `dense_linear`). gpu_worker/quantization.py routes each
call (its module docstring has the measurements behind these choices).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor
from laneserve.gpu_worker.hardware import cpu_flags, cpu_has_fast_bf16
from laneserve.gpu_worker.kernel_routes import (
    DENSE_COPY_MAX_BYTES,
    DENSE_MIN_TOKENS,
    DENSE_MIN_TOKENS_FP32,
    DENSE_MIN_TOKENS_FP32_GGUF_ORDER,
)

logger = logging.getLogger(__name__)


def int4_blocked_cpu() -> bool:
    """Whether this CPU's build of the C++ int4 GEMV reads the block order (AVX2 without
    AVX-512BW: `int4_kernel_block_groups` is 8 there), from the CPU flags the ``-march=native``
    build follows, so routing can be chosen before the kernels are built."""
    flags = cpu_flags()
    return "avx2" in flags and not {"avx512f", "avx512bw"} <= flags


def dense_copy_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the dense copy kept for large-M calls, or None for no copy.

    float32 activations keep a float32 copy (large calls on oneDNN's float32 GEMM, see
    DENSE_MIN_TOKENS_FP32); bf16/fp16 ones a copy in their dtype only on a CPU with AMX or
    AVX512-BF16, where those GEMMs beat the int4 kernel from DENSE_MIN_TOKENS rows.
    """
    if dtype == torch.float32 or cpu_has_fast_bf16():
        return dtype
    return None


def dense_min_tokens(dtype: torch.dtype) -> int:
    """From how many rows a call runs on the dense copy (see `dense_copy_dtype`)."""
    if dtype != torch.float32:
        return DENSE_MIN_TOKENS
    return DENSE_MIN_TOKENS_FP32 if int4_blocked_cpu() else DENSE_MIN_TOKENS_FP32_GGUF_ORDER


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """A bf16/fp16 CPU weight [N, K] in oneDNN's blocked layout for `dense_linear` (results equal
    `F.linear`'s bit for bit); float32 and CUDA weights, or a torch without oneDNN, stay as they
    are (oneDNN's float32 GEMM rounds differently from `F.linear`'s)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.bfloat16, torch.float16)
        or not torch.backends.mkldnn.is_available()
    ):
        return weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except (RuntimeError, AttributeError) as exc:  # an unsupported CPU or build: plain weights
        logger.debug("oneDNN weight packing unavailable: %s", exc)
        return weight


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear` for a plain or a `pack_dense`ed weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense_copies_fit(weights: dict, dtype: torch.dtype) -> bool:
    """Whether the dense copies `build_linear` would make of a model's Q8_0 linears (from its
    checkpoint's `weights`, GGUF blocks among them: every 2-D Q8_0 tensor, the embedding only
    where no `lm_head.weight` is there, so that it is the head too) fit `DENSE_COPY_MAX_BYTES` in
    `dtype`'s copy dtype.
    A 1B model's Q8_0 weights took 2.36 GB more as bf16 copies (4.7 GB as float32): past the
    limit its Q8_0 linears run big calls on tiles (`QuantLinear` `tiled`)."""
    copy = dense_copy_dtype(dtype)
    if copy is None:
        return True
    untied = "lm_head.weight" in weights
    count = sum(
        t.shape[0] * t.shape[1]
        for name, t in weights.items()
        if isinstance(t, GGUFQuantTensor) and t.qtype == "Q8_0" and len(t.shape) == 2
        and not (untied and name == "model.embed_tokens.weight")
    )  # fmt: skip
    return count * copy.itemsize <= DENSE_COPY_MAX_BYTES
