"""laneserve kernels: paged attention, KV-cache writes and fused Llama layer ops.

Each op has a Triton implementation (``kernels.triton``) and a plain-PyTorch reference
(``kernels.reference``) with the same signature. The functions here check their arguments
(see :mod:`laneserve.kernels._validate`) and dispatch: Triton for CUDA tensors, the reference elsewhere.
``LANESERVE_ATTENTION_BACKEND=torch|triton`` overrides the choice for every op (``triton`` on CPU
tensors runs them in the Triton interpreter: on a machine without CUDA the first forced call sets
``TRITON_INTERPRET=1`` before ``kernels.triton`` is imported). On CPU the torch backend runs the
fused layer ops (RMSNorm with its residual add, SiLU-mul, RoPE with the cache write), decode
attention and multi-token (prefill) attention as one C++ op each (:mod:`laneserve.kernels.cpu_ext`: the
layer ops with the reference's numerics, attention within tolerance of it) when that extension
is built, the reference otherwise. A model's forward gets its layer ops from
:func:`step_ops`, which checks one step's tensors once and then calls those C++ ops directly.

Note: this top-level package shadows Hugging Face's optional ``kernels`` package; never install
both in one environment (see DESIGN.md).
"""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import torch

from laneserve.contracts import env
from laneserve.kernels import _validate, cpu_ext, reference

__all__ = [
    "unified_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "rope_and_cache",
    "step_ops",
    "backend_for",
    "reference",
]

logger = logging.getLogger(__name__)

BACKEND_ENV = "LANESERVE_ATTENTION_BACKEND"
_BACKENDS = ("torch", "triton")


def backend_for(t: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for an op whose main input is ``t``.

    Raises:
        ValueError: ``LANESERVE_ATTENTION_BACKEND`` is set to something other than torch|triton.
    """
    forced = env.get(BACKEND_ENV)
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if t.is_cuda else "torch"


def _impl(t: torch.Tensor):
    if backend_for(t) == "triton":
        if (
            "laneserve.kernels.triton" not in sys.modules
            and not t.is_cuda
            and not torch.cuda.is_available()
        ):
            # Forced Triton on a machine without a GPU: the kernels can only run interpreted, and
            # triton reads TRITON_INTERPRET when the kernels are defined, i.e. on first import.
            if not env.get("TRITON_INTERPRET"):
                logger.info("no CUDA device: running Triton kernels with TRITON_INTERPRET=1")
                os.environ["TRITON_INTERPRET"] = "1"
        from laneserve.kernels import triton as triton_backend  # lazy: importing triton costs ~1 s

        return triton_backend
    return reference


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
    """Causal paged attention for a mixed batch of decode tokens and prefill chunks (one launch).

    Shapes: q ``[num_tokens, num_q_heads, head_dim]``; k_cache/v_cache ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; cu_seqlens_q int32 ``[num_seqs + 1]``; seq_lens int32 ``[num_seqs]``
    (context length including this step's query tokens); block_tables int32
    ``[num_seqs, max_blocks_per_seq]``. ``sliding_window`` ``W`` (tokens, ``None``: none): a query
    at absolute position ``i`` attends keys ``i - W < j <= i``, as transformers' ``sliding_window``.
    See :func:`laneserve.kernels.reference.unified_attention`.

    Raises:
        TypeError / ValueError: wrong dtype / shape, device or layout, or a ``sliding_window``
            that is not a positive int (the message names the argument).
    """
    _validate.attention_args(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, softmax_scale, out
    )
    _validate.sliding_window_arg(sliding_window)
    return _impl(q).unified_attention(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        softmax_scale,
        out,
        sliding_window=sliding_window,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value ``[num_tokens, num_kv_heads, head_dim]`` to flat cache slots (in place).

    slot_mapping int64 ``[num_tokens]`` = block * block_size + offset; negative slots are skipped.
    See :func:`laneserve.kernels.reference.reshape_and_cache`. Raises TypeError / ValueError on bad input.
    """
    _validate.cache_args(key, value, k_cache, v_cache, slot_mapping)
    return _impl(key).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x [..., hidden]``; with ``residual`` returns ``(out, x + residual)``.

    See :func:`laneserve.kernels.reference.rms_norm`. Raises TypeError / ValueError on bad input.
    """
    _validate.rms_norm_args(x, weight, eps, residual)
    if _cpu_fused(x, weight, *(() if residual is None else (residual,))):
        return _fused_rms_norm(x, weight, eps, residual)
    return _impl(x).rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE applied in place to q ``[T, Hq, D]`` and k ``[T, Hk, D]``; returns ``(q, k)``.

    cos_sin_cache ``[max_pos, D]`` = cat(cos, sin). See :func:`laneserve.kernels.reference.rotary_embedding`.
    Raises TypeError / ValueError on bad input.
    """
    _validate.rotary_args(positions, q, k, cos_sin_cache)
    return _impl(q).rotary_embedding(positions, q, k, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2I] -> [..., I]`` = silu(x[..., :I]) * x[..., I:]. See :func:`laneserve.kernels.reference.silu_and_mul`."""
    _validate.silu_and_mul_args(x)
    if _cpu_fused(x):
        return torch.ops.laneserve.silu_and_mul(x)
    return _impl(x).silu_and_mul(x)


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """RoPE on the q and k parts of a fused projection, k and v written to the cache: returns q.

    ``qkv`` ``[T, (Hq + 2 Hk) * D]`` = cat(q, k, v) per token; positions int64 ``[T]``;
    cos_sin_cache fp32 ``[max_pos, rot_dim]``; caches ``[num_blocks, block_size, Hk, D]``;
    slot_mapping int64 ``[T]`` (negative: not written). Returns the rotated q ``[T, Hq, D]``.
    Same numerics as :func:`rotary_embedding` followed by :func:`reshape_and_cache`, which is what
    runs when the C++ op cannot take the tensors. Raises TypeError / ValueError on bad input.
    """
    head_dim = k_cache.shape[-1]
    _validate.rope_and_cache_args(qkv, num_q_heads, num_kv_heads, head_dim)
    if (
        _cpu_fused(qkv, k_cache, v_cache, dense=False)
        and qkv.is_contiguous()
        and positions.dtype == slot_mapping.dtype == torch.int64
        and cos_sin_cache.dtype == torch.float32
        and positions.shape[0] == slot_mapping.shape[0] == qkv.shape[0]
    ):
        return torch.ops.laneserve.rope_and_cache(
            qkv,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            num_q_heads,
            num_kv_heads,
        )
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_q_heads, head_dim).contiguous()  # [T, Hq, D]
    k = k.reshape(-1, num_kv_heads, head_dim).contiguous()  # [T, Hk, D]
    v = v.reshape(-1, num_kv_heads, head_dim).contiguous()
    rotary_embedding(positions, q, k, cos_sin_cache)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def _cpu_fused(first: torch.Tensor, *others: torch.Tensor, dense: bool = True) -> bool:
    """Whether the C++ CPU op can take these tensors: CPU, one dtype, torch backend, 2-D dense
    (``dense``) or with a contiguous last dimension, and the extension built."""
    if first.device.type != "cpu" or backend_for(first) != "torch":
        return False
    for t in (first, *others):
        if t.dtype != first.dtype or t.stride(-1) != 1 or t.device.type != "cpu":
            return False
        if dense and t is first and (t.dim() != 2 or not t.is_contiguous()):
            return False
        if dense and not t.is_contiguous():
            return False
    return cpu_ext.load()


def _fused_rms_norm(x, weight, eps, residual=None):
    """The C++ RMSNorm (with the residual add when given), unchecked."""
    if residual is None:
        return torch.ops.laneserve.rms_norm(x, weight, eps)
    return torch.ops.laneserve.fused_add_rms_norm(x, residual, weight, eps)


def _fused_decode_attention(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, *, sliding_window=None
):
    if sliding_window:
        return reference.unified_attention(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            seq_lens,
            block_tables,
            scale,
            sliding_window=sliding_window,
        )
    return torch.ops.laneserve.paged_decode_attention(
        q, k_cache, v_cache, seq_lens, block_tables, scale
    )


# The layer ops a forward calls (`step_ops`): checked (the functions above) or straight to C++.
_CHECKED_OPS = SimpleNamespace(
    rms_norm=rms_norm,
    rope_and_cache=rope_and_cache,
    unified_attention=unified_attention,
    silu_and_mul=silu_and_mul,
)
_FUSED_OPS = SimpleNamespace(
    rms_norm=_fused_rms_norm,
    rope_and_cache=lambda *args: torch.ops.laneserve.rope_and_cache(*args),
    unified_attention=reference.unified_attention,
    silu_and_mul=lambda x: torch.ops.laneserve.silu_and_mul(x),
)
_FUSED_DECODE_OPS = SimpleNamespace(
    **{**vars(_FUSED_OPS), "unified_attention": _fused_decode_attention}
)


def step_ops(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> SimpleNamespace:
    """The layer ops (``rms_norm``, ``rope_and_cache``, ``unified_attention``, ``silu_and_mul``)
    for one forward over the hidden states ``x [T, H]``, with the signatures above
    (``unified_attention`` takes the ``sliding_window`` keyword of the layer calling it).

    When the C++ CPU ops take this step's tensors (CPU, torch backend, one float dtype, dense
    ``x``, caches with a contiguous head dimension, int64 positions and slots, int32 metadata,
    fp32 ``cos_sin_cache``), the returned ops call them directly: every layer's tensors have the
    same dtypes, devices and layouts as the first, so checking them once here replaces the
    per-call Python checks (about 240 a decode step). The C++ ops still check shapes, block ids,
    positions and slots on every call. A pure decode step (one token per sequence) also goes
    straight to the in-place decode kernel. Otherwise the checked functions above.
    """
    if not (
        x.dtype in _validate.FLOAT_DTYPES
        and x.dim() == 2
        and positions.dtype == slot_mapping.dtype == torch.int64
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.stride(-1) == 1
        and seq_lens.dtype == block_tables.dtype == torch.int32
        and seq_lens.is_contiguous()
        and block_tables.stride(-1) == 1
        and _cpu_fused(x, norm_weight)
        and _cpu_fused(x, k_cache, v_cache, dense=False)
    ):
        return _CHECKED_OPS
    return _FUSED_DECODE_OPS if x.shape[0] == seq_lens.shape[0] else _FUSED_OPS
