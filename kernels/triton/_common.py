"""Helpers shared by the Triton kernel wrappers: interpreter detection and layout checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Whether this process's @triton.jit kernels were built for the interpreter. triton reads
# TRITON_INTERPRET when a kernel is decorated, i.e. when the kernels.triton modules are imported.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def check_device(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``t`` cannot be used by a Triton kernel in this process."""
    if t.is_cuda:
        if INTERPRET:
            raise ValueError(
                f"{name} is a CUDA tensor but triton kernels were built for the interpreter "
                "(TRITON_INTERPRET=1); unset it to run on the GPU"
            )
        return
    if t.device.type == "cpu" and INTERPRET:
        return
    raise ValueError(
        f"{name} is on {t.device}; the Triton backend needs CUDA tensors, or CPU tensors with "
        "TRITON_INTERPRET=1 set before kernels.triton is imported"
    )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the last dimension of ``t`` has stride 1."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` is contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to ``DTYPE`` with round-to-nearest-even and return it as fp32.

    What an op computed in ``DTYPE`` returns. bf16 is rounded with integer ops because the Triton
    interpreter truncates fp32 -> bf16 casts; after this, a ``.to(DTYPE)`` cast is exact on every
    backend. NaN payloads are not preserved (irrelevant here).
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)  # round half to even at bit 16
        bits = (bits >> 16) << 16  # shifts keep uint32 (a 0xFFFF0000 mask would widen to int64)
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
