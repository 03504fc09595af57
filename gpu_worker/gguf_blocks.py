"""GGUF's quantized weight blocks (Q4_0, Q4_1, Q8_0; the K-quants Q4_K, Q5_K, Q6_K) and their
unpacked forms.

A `GGUFQuantTensor` holds one GGUF tensor in its blocks (rows in Hugging Face order); `Int4Groups`
is a group-32 int4 weight unpacked from them (`int4_from_gguf`, exact) or rounded from a float
weight (`int4_from_float`); `int8_from_float` requantizes per output channel; `q8_0_arrays` and
`dequantize` read the blocks' exact values. gpu_worker/quantization.py builds its linears from
these.

GGUF block layouts (ggml `block_q4_0`, `block_q4_1`, `block_q8_0`, 32 weights per block):

    Q4_0: d fp16 | qs[16]            weight j = d * ((qs[j % 16] >> 4 * (j // 16)) & 15) - 8 d
    Q4_1: d fp16 | m fp16 | qs[16]   weight j = d * ((qs[j % 16] >> 4 * (j // 16)) & 15) + m
    Q8_0: d fp16 | qs[32] int8       weight j = d * qs[j]

torch's int4 convention is `W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`: Q4_1 maps
exactly with scale = d, zero = m + 8 d; Q4_0 with scale = d, zero = 0.

The K-quants' 256-weight super-blocks (layouts in kernels/csrc/kquant_gemv.cpp) run as they ship
through gpu_worker/kquant.py; `dequantize` reads them with the `gguf` package's own dequantization.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

from laneserve.gpu_worker.errors import ModelLoadError

GROUP_SIZE = 32  # GGUF's block size for Q4_0 / Q4_1 / Q8_0, and the int4 kernel's group size
GGUF_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # loaded as quantized linears without dequantizing
K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # kept in their super-blocks (gpu_worker/kquant.py)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_BLOCK_WEIGHTS = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # the others: GROUP_SIZE


@dataclass(slots=True)
class GGUFQuantTensor:
    """One GGUF tensor kept in its quantized blocks (rows already in Hugging Face order).

    blocks: uint8 [N, K / 32 * block_bytes]   row n holds the K / 32 blocks of output channel n
    (K / 256 super-blocks for the K-quants)
    """

    name: str
    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0" | "Q4_K" | "Q5_K" | "Q6_K"
    blocks: np.ndarray
    shape: tuple[int, int]  # (N, K) in Hugging Face layout [out, in]

    def __post_init__(self) -> None:
        n, k = self.shape
        per_block = _BLOCK_WEIGHTS.get(self.qtype, GROUP_SIZE)
        expected = (n, k // per_block * _BLOCK_BYTES[self.qtype])
        assert self.blocks.shape == expected, (self.name, self.blocks.shape, expected)


@dataclass(slots=True)
class Int4Groups:
    """Unpacked group-32 int4 weight: W[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32].

    q: uint8 [N, K] in 0..15; scale, zero: float32 [N, K / 32].
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        n, k = self.q.shape
        w = self.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float().sub_(8.0)
        return w.mul_(self.scale[..., None]).add_(self.zero[..., None]).reshape(n, k)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Concatenate along the output dimension (fused qkv / gate_up projections)."""
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[N, B, 16] packed bytes -> [N, B * 32] values 0..15 in ggml's order (low nibbles first)."""
    n, b, _ = qs.shape
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, b * GROUP_SIZE)


def int4_from_gguf(t: GGUFQuantTensor) -> Int4Groups:
    """Q4_0 / Q4_1 blocks as `Int4Groups`, exactly (the GGUF values, no rounding)."""
    n, k = t.shape
    raw = t.blocks.reshape(n, k // GROUP_SIZE, _BLOCK_BYTES[t.qtype])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if t.qtype == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero, qs = m + 8.0 * d, raw[..., 4:]
    elif t.qtype == "Q4_0":
        zero, qs = np.zeros_like(d), raw[..., 2:]
    else:
        raise ValueError(f"{t.name}: {t.qtype} is not a 4-bit type")
    q = torch.from_numpy(_nibbles(qs))
    return Int4Groups(q, torch.from_numpy(d), torch.from_numpy(zero))


def dequantize_q8_0(t: GGUFQuantTensor) -> torch.Tensor:
    """Q8_0 blocks -> float32 [N, K] (exact: fp16 scale x int8)."""
    n, k = t.shape
    raw = t.blocks.reshape(n, k // GROUP_SIZE, _BLOCK_BYTES["Q8_0"])
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, B, 1]
    qs = raw[..., 2:].copy().view(np.int8).astype(np.float32)  # [N, B, 32]
    return torch.from_numpy((qs * d).reshape(n, k))


def dequantize(t: GGUFQuantTensor) -> torch.Tensor:
    """Any supported GGUF quantized tensor -> float32 [N, K]."""
    if t.qtype == "Q8_0":
        return dequantize_q8_0(t)
    if t.qtype in K_QUANT_TYPES:
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(t.blocks, GGMLQuantizationType[t.qtype])
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(t.shape))
    return int4_from_gguf(t).dequantize()


def int4_from_float(weight: torch.Tensor) -> Int4Groups:
    """Round-to-nearest asymmetric group-32 int4 of a float weight [N, K] (K a multiple of 32):
    per group, scale = (max - min) / 15 and zero = min + 8 scale (torch's int4 convention)."""
    n, k = weight.shape
    _check_in_features("int4", k, GROUP_SIZE)
    w = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(n, k), scale, lo + 8.0 * scale)


def int8_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8 of a float weight [N, K]: (q int8 [N, K], scale float32 [N])."""
    _check_in_features("int8", weight.shape[1], 16)  # torch's int8 matmul crashes on other K
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def _check_in_features(kind: str, k: int, multiple: int) -> None:
    if k % multiple:
        raise ModelLoadError(
            f"the {kind} weight-only kernel needs in_features divisible by {multiple}; a weight "
            f"has {k} (load this model with quantization='none')"
        )


def q8_0_arrays(t: GGUFQuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks as (qs int8 [N, K], d float32 [N, K / 32]): w = qs * d, exactly."""
    n, k = t.shape
    raw = t.blocks.reshape(n, k // GROUP_SIZE, _BLOCK_BYTES["Q8_0"])
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    return torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(n, k)), d


def q8_0_values(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weights of Q8_0 arrays (`q8_0_arrays`, or rows of them): qs * d, exactly."""
    return (qs.view(qs.shape[0], -1, GROUP_SIZE).float() * d[..., None]).view_as(qs)


def drop_file_pages(view: np.ndarray) -> None:
    """Drop the pages of a read-only memory-mapped tensor `view` from this process once it was
    copied out (madvise MADV_DONTNEED; the page cache keeps them, a later read maps them again).
    Without it a dequantized or copied tensor counts twice in the load's peak RSS: its copy and
    the file pages the copy touched (F32 tensors in gpu_worker/gguf_loader.py, the blocks of a
    Q8_0 / Q4_x linear once built: `models.checkpoint.WeightReader.drop`)."""
    if view.flags.writeable or view.nbytes < mmap.PAGESIZE or not hasattr(os, "posix_fadvise"):
        return  # our own memory, too small to hold a whole page, or not Linux
    start = -(-view.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (view.ctypes.data + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)
