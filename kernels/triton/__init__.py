"""Triton implementations of the laneserve kernels (same signatures as :mod:`laneserve.kernels.reference`).

Importing this package builds the @triton.jit kernels: set ``TRITON_INTERPRET=1`` before importing
it to run them on CPU tensors (tests). Prefer the dispatching functions in :mod:`kernels`, which
validate arguments first.
"""

from __future__ import annotations

from laneserve.kernels.triton.attention import unified_attention
from laneserve.kernels.triton.cache import reshape_and_cache
from laneserve.kernels.triton.layer_ops import rms_norm, rotary_embedding, silu_and_mul

__all__ = ["unified_attention", "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]
