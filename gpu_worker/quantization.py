"""Weight-only quantized linears (int4 group-32 and int8 per-channel) for the CPU decode path.

DESIGN.md "Quantization": `quantization="auto"|"none"|"int8"|"int4"`. Decode rows are
bandwidth-bound (every token reads every weight), so reading 4-bit weights instead of bf16 ones
cuts the bytes per step about 4x; activations stay in the model's dtype (float32 or bfloat16).

Kernel choice by phase and CPU (measured with scripts/bench_quant.py, docs/benchmarks.md):

- bf16 activations (`dtype="auto"` on a CPU with AMX/AVX512-BF16): calls of at least
  `DENSE_MIN_TOKENS` rows (prefill chunks, big decode batches: compute-bound) run as dense GEMMs
  on a bf16 copy of the same weights; smaller ones (decode) read the 4-bit weights through
  torch's int4 kernel except from `BF16_GEMV_MIN_TOKENS` (5) to `BF16_GEMV_MAX_TOKENS` (7) rows
  where the CPU has AVX512-BF16: there laneserve's bf16 GEMV (a batch-1 speculative
  verification: torch's kernel unpacks its weights once per 4 rows). The copy costs ~2 bytes
  per weight (269 MB for SmolLM2-135M, whose int4/int8 weights and Q8_0 embedding take 127 MB)
  and buys 2-2.5x on every linear from 64 rows up. The copy is held in oneDNN's blocked layout
  (`pack_dense`): the same results as `F.linear` on the plain copy, bit for bit, without reordering
  the weight on every call (SmolLM2's linears at 16 / 64 / 512 rows: 0.6-0.7x / 0.8-0.9x /
  0.95-0.97x of `F.linear`'s time). On a CPU without native bf16 no copy is kept: its bf16 GEMMs are
  slower than the int4 kernel at every row count.
- bf16 activations on a CPU with AMX-BF16 (`amx_usable`): calls of `AMX_MIN_TOKENS` (5) to
  `AMX_MAX_TOKENS` (512) rows run laneserve's AMX matmuls over the int4 and Q8_0 blocks
  (kernels/cpu_ext_amx.py: each 16-output x 32-input weight tile dequantized once to bf16 for
  all the rows of x, so 5 rows cost about what 1 does and a 512-token prefill reads 4-bit
  weights instead of the bf16 copy), ahead of the bf16 GEMV and the dense copy.
- float32 activations (`dtype="auto"` on a CPU without native bf16): below `dense_min_tokens`
  rows the C++ GEMVs (kernels/cpu_ext_quant.py) read the GGUF's values (int4 ones reordered once
  into blocks of 8 groups where the kernel was built for AVX2 without AVX-512BW,
  `int4_block_order`), each activation row rounded to 16-bit
  integers per 32-element group for integer dot products (~3e-5 relative to float32
  activations; bf16 rounding is ~4e-3); from `dense_min_tokens(torch.float32)` rows (96 with the
  block order, 48 otherwise) a dense float32 copy
  (4 bytes per weight) runs oneDNN's GEMM on the activations as they are. Both use the exact GGUF
  values, so kernel switches change outputs by that rounding and float32 summation order only.

The embedding of a GGUF stays in its Q8_0 blocks (exact lookups, 31 MB instead of 57 MB bf16).
A tied LM head over it (SmolLM2's) reads those same blocks (exact; where the kernel was built for
AVX-512BW its int16 path reads a copy of them in blocks of 16 groups, `GemvBlocks.block_copy`,
28 MB for SmolLM2) through the C++ GEMV below its dense threshold whatever the activations'
dtype (float32 ones, where the int4 GEMV reads the block order, below
`Q8_0_HEAD_DENSE_MIN_TOKENS_FP32`; bf16 ones of fewer than `BF16_GEMV_MIN_TOKENS` rows read
exactly by the kernel and rounded to int16 as above, the result rounded once to bf16, more rows
through the bf16 GEMV where it runs and, timed once per linear, beats the int16 path
(`QuantLinear.bf16_gemv_pays`); every row count when there is no dense copy): on a 2-core Zen 4
with AVX512-BF16 its float32-activation version streamed the 49,152 x 576 head at ~27 GB/s,
0.5-0.6x the time of torch's per-channel int8 kernel from 1 to 3 rows and 0.55-0.9x up to 9 (which
requantizes the Q8_0 blocks, and reads them at ~13 GB/s at one row); the int16 version was
measured on an AVX2 EPYC only (its Q8_0 GEMV 0.65-0.75x the float32-activation version's time
at one row, its int4 GEMV 0.47-0.61x). The int8 copy stays as the path without the C++ kernels;
requantizing Q8_0 to int4 would cost ~8x the int8 error.

Kernels (torch CPU, ATen):

- `_weight_int4pack_mm_for_cpu(x [M, K], packed [N, K/2] uint8, 32, scale_zeros [K/32, N, 2])`
  computes `x @ W.T` with `W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`, `g = k // 32`,
  `q` in 0..15 (torch's convention, checked in tests/kernels/test_kernels_quant.py). GGUF Q4_1
  (`w = d * q + m`) maps exactly with scale = d, zero = m + 8 d; Q4_0 (`w = d * (q - 8)`) with
  scale = d, zero = 0.
- `_weight_int8pack_mm(x [M, K], q [N, K] int8, scale [N])` computes `x @ (q * scale[:, None]).T`.
  GGUF Q8_0 (32-element blocks with their own fp16 scale) has no exact kernel; it is requantized
  per output channel (symmetric, max-abs / 127).

GGUF block layouts (ggml `block_q4_0`, `block_q4_1`, `block_q8_0`, 32 weights per block):

    Q4_0: d fp16 | qs[16]            weight j = d * ((qs[j % 16] >> 4 * (j // 16)) & 15) - 8 d
    Q4_1: d fp16 | m fp16 | qs[16]   weight j = d * ((qs[j % 16] >> 4 * (j // 16)) & 15) + m
    Q8_0: d fp16 | qs[32] int8       weight j = d * qs[j]
"""

from __future__ import annotations

import functools
import logging
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from laneserve.contracts import env
from laneserve.gpu_worker.config import QUANTIZATIONS as QUANTIZATION_MODES
from laneserve.kernels import cpu_ext

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # GGUF's block size for Q4_0 / Q4_1 / Q8_0, and the int4 kernel's group size
GGUF_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # loaded as quantized linears without dequantizing
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def check_mode(mode: str) -> str:
    """Return `mode` if it is one of `QUANTIZATION_MODES`.

    Raises:
        ValueError: any other value.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}"
        )
    return mode


def resolve_mode(mode: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The mode the model is built with. On CPU every mode; `auto` is the checkpoint's own
    format. On CUDA `auto` means `none` (dequantized weights: not yet measured against the int4
    kernel on a GPU) and `int4` runs torch's CUDA int4 kernel (`_weight_int4pack_mm`, bf16
    activations only); `int8` has no CUDA kernel here.

    Raises:
        ValueError: an unknown mode; `int8` off the CPU; `int4` on CUDA with activations other
            than bfloat16, or on any other device.
    """
    check_mode(mode)
    if device.type == "cpu" or mode == "none":
        return mode
    if mode == "auto":
        logger.info("quantization=auto on %s: weights are dequantized", device)
        return "none"
    if mode == "int4" and device.type == "cuda":
        if dtype not in (None, torch.bfloat16):
            raise ValueError(f"quantization='int4' on CUDA needs dtype bfloat16, not {dtype}")
        return mode
    raise ValueError(f"quantization={mode!r} is not implemented on {device.type}")


# --------------------------------------------------------------------------- unpacked forms


@dataclass(slots=True)
class GGUFQuantTensor:
    """One GGUF tensor kept in its quantized blocks (rows already in Hugging Face order).

    blocks: uint8 [N, K / 32 * block_bytes]   row n holds the K / 32 blocks of output channel n
    """

    name: str
    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    blocks: np.ndarray
    shape: tuple[int, int]  # (N, K) in Hugging Face layout [out, in]

    def __post_init__(self) -> None:
        n, k = self.shape
        expected = (n, k // GROUP_SIZE * _BLOCK_BYTES[self.qtype])
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
    return int4_from_gguf(t).dequantize()


def int4_from_float(weight: torch.Tensor) -> Int4Groups:
    """Round-to-nearest asymmetric group-32 int4 of a float weight [N, K] (K a multiple of 32):
    per group, scale = (max - min) / 15 and zero = min + 8 scale (torch's int4 convention)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(n, k), scale, lo + 8.0 * scale)


def int8_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8 of a float weight [N, K]: (q int8 [N, K], scale float32 [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def q8_0_arrays(t: GGUFQuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks as (qs int8 [N, K], d float32 [N, K / 32]): w = qs * d, exactly."""
    n, k = t.shape
    raw = t.blocks.reshape(n, k // GROUP_SIZE, _BLOCK_BYTES["Q8_0"])
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    return torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(n, k)), d


@dataclass(slots=True)
class GemvBlocks:
    """A weight in the layout of the C++ GEMVs (kernels/cpu_ext_quant.py). float32 activations
    are rounded by the kernel to int16 per 32-element group; bf16 ones are multiplied as they are
    with the weights rounded to bf16 where the CPU has AVX512-BF16 (`gemv_takes_bf16`), else
    read as float32 (exact) through the int16 path, the result rounded once to bf16.

    int4: qs uint8 [N, K/2] (ggml's nibble order while `block_groups` is 1; `prepare` reorders
    them into the blocks of groups the built kernel reads, `int4_block_order`), scale and offset
    float32 [N, K/32] with W = q * scale + offset (the GGUF's own d and m: no bf16 rounding);
    q8_0: qs int8 [N, K], scale float32 [N, K/32] (the Q8_0 blocks, exact), offset None. A
    tied LM head's blocks (`QuantLinear.read_q8_0_blocks` sets `block_copy`) get, where the kernel
    was built for AVX-512BW, `qs_blocks` from `prepare`: the same weights in blocks of 16 groups
    (`q8_0_block_order`) for the int16 path, beside `qs` (the embedding's own array, and what
    the bf16 path reads): 1.0 more byte per weight (28 MB for SmolLM2's head) for 0.7-0.9x
    the int16 path's time on that head from 4 rows up (whole bf16 decode steps of 2-8 rows
    0.94-0.99x on a 2-core Zen 4, docs/benchmarks.md Run 15). Other Q8_0 blocks keep the
    GGUF's order only (a copy would double them).
    """

    kind: str  # "int4" | "q8_0"
    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None
    block_groups: int = 1  # int4: the order qs is in (1: the GGUF's)
    block_copy: bool = False  # q8_0: `prepare` adds `qs_blocks` (a tied LM head's)
    qs_blocks: torch.Tensor | None = None  # q8_0: qs in `q8_0_block_order` (after `prepare`)
    # where the AMX matmuls run (`amx_usable`): the same weights in their layout (`amx_order`),
    # added by `prepare`; bf16 calls of `AMX_MIN_TOKENS` to `AMX_MAX_TOKENS` rows read them
    amx_qs: torch.Tensor | None = None
    amx_scale: torch.Tensor | None = None
    # whether `prepare` adds the AMX copy: set by the builders for a bf16 model's linears only,
    # so no other model holds a copy no call reads (scripts/bench_quant.py's `noamx` clears it)
    use_amx: bool = False

    @staticmethod
    def from_int4(groups: Int4Groups) -> GemvBlocks:
        n, k = groups.q.shape
        q = groups.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        offset = groups.zero - 8.0 * groups.scale  # (q - 8) * s + z = q * s + (z - 8 s)
        return GemvBlocks("int4", qs, groups.scale.contiguous(), offset.contiguous())

    @staticmethod
    def from_q8_0(parts: list[GGUFQuantTensor]) -> GemvBlocks:
        qs, d = zip(*(q8_0_arrays(p) for p in parts), strict=True)
        return GemvBlocks("q8_0", torch.cat(qs).contiguous(), torch.cat(d).contiguous())

    def nbytes(self) -> int:
        tensors = (self.qs, self.scale, self.offset, self.qs_blocks, self.amx_qs, self.amx_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def prepare(self) -> None:
        """Reorder int4 weights into the order the built kernel reads, or add the block-order
        copy of Q8_0 ones (once; needs `kernels.cpu_ext.load()`). The model runner calls it ahead
        of the first step (`LlamaForCausalLM.prepare_gemv_blocks`) when the kernels are built; a
        worker that builds them in the background reorders each linear on its first call after
        they load (SmolLM2's 120 int4 linears: ~0.5 s in all on 2 cores, once). Where the AMX
        matmuls run, every block first gets its `amx_order` copy (read from the GGUF's order)."""
        if self.use_amx and self.amx_qs is None and self.qs.shape[0] % 16 == 0 and amx_usable():
            with _PREPARE_LOCK:
                if self.amx_qs is None and (self.kind == "q8_0" or self.block_groups == 1):
                    qa, sa = amx_order(self.kind, self.qs, self.scale, self.offset)
                    self.amx_scale = sa
                    self.amx_qs = qa  # last: a set `amx_qs` means the copy is whole
        if self.kind == "q8_0":
            if self.block_copy and self.qs_blocks is None and q8_0_kernel_block_groups() > 1:
                with _PREPARE_LOCK:
                    if self.qs_blocks is None:
                        self.qs_blocks = q8_0_block_order(self.qs)
            return
        want = int4_kernel_block_groups()
        if self.block_groups == want:
            return
        with _PREPARE_LOCK:
            if self.block_groups != want:
                if self.block_groups != 1:
                    raise ValueError(f"int4 blocks of {self.block_groups} groups, need {want}")
                self.qs = int4_block_order(self.qs)
                self.block_groups = want

    def takes_amx(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs the AMX matmul (`amx_takes`, and the blocks have their AMX
        copy, which `prepare` adds where the matmuls run; needs `kernels.cpu_ext.load()`)."""
        if not amx_takes(x.shape[0], x.dtype):
            return False
        self.prepare()
        return self.amx_qs is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 or bf16 [M, K], contiguous -> [M, N] in x's dtype (needs
        `kernels.cpu_ext.load()`)."""
        if self.kind == "int4":
            self.prepare()
            if self.amx_qs is not None and amx_takes(x.shape[0], x.dtype):
                return torch.ops.laneserve.int4_amx(x, self.amx_qs, self.amx_scale)
            return torch.ops.laneserve.int4_gemv(
                x, self.qs, self.scale, self.offset, self.block_groups
            )
        self.prepare()
        if self.amx_qs is not None and amx_takes(x.shape[0], x.dtype):
            return torch.ops.laneserve.q8_0_amx(x, self.amx_qs, self.amx_scale)
        if self.qs_blocks is not None and not (
            x.dtype == torch.bfloat16 and x.shape[0] >= BF16_GEMV_MIN_TOKENS and gemv_takes_bf16()
        ):  # the int16 path (the bf16 one reads the GGUF's order)
            return torch.ops.laneserve.q8_0_gemv(x, self.qs_blocks, self.scale, Q8_0_BLOCK_GROUPS)
        return torch.ops.laneserve.q8_0_gemv(x, self.qs, self.scale, 1)


_PREPARE_LOCK = threading.Lock()
INT4_BLOCK_GROUPS = 8  # the block order's groups per block (kInt4BlockGroups with AVX2)
Q8_0_BLOCK_GROUPS = 16  # the Q8_0 block order's (kQ8BlockGroups with AVX-512BW)


@functools.cache
def q8_0_kernel_block_groups() -> int:
    """16 where the built C++ GEMV's int16 path reads Q8_0 weights in `q8_0_block_order`
    (AVX-512BW), 1 (the GGUF's order only) elsewhere."""
    return int(torch.ops.laneserve.q8_0_gemv_block_groups())


# bf16 calls from this many rows up to AMX_MAX_TOKENS run the AMX matmuls where they run
# (`amx_usable`; kernels/cpu_ext_amx.py), whatever the GEMV or dense thresholds say. Whole bf16
# SmolLM2 decode steps on a 2-core Xeon with AMX (`scripts/bench_quant.py --steps --quantization
# auto,auto-noamx`, the two alternating), time with / without: 3 rows 1.30x, 4 rows 1.07x (torch's
# int4 kernel unpacks its weights once per 4 rows), 5 rows 0.74x, 8 rows 0.68-0.73x, 16 rows
# 0.58-0.68x; since each pass's tiles are dequantized once for all its rows (not once per 16),
# 32 rows 0.70-0.82x, 64 rows 0.78-0.87x, 128 rows 0.87-0.95x, 256 rows 0.92-0.94x and a
# 512-token prefill 0.90-0.94x against the dense copy (docs/benchmarks.md Run 20). In a loop
# (weights in cache) the dense copy wins from ~1,024 rows, so it keeps the calls above 512.
AMX_MIN_TOKENS = 5
AMX_MAX_TOKENS = 512


def amx_usable() -> bool:
    """Whether the built C++ kernels run the AMX matmuls here: a CPU with AMX-BF16 (the build
    is ``-march=native``) whose kernel granted this process the tile state. False while the
    kernels are not built (asked again later), and with ``LANESERVE_AMX=0``."""
    if not cpu_ext.load():
        return False
    return _amx_granted()


@functools.cache
def _amx_granted() -> bool:
    return env.get("LANESERVE_AMX") and bool(torch.ops.laneserve.amx_usable())


def amx_takes(rows: int, dtype: torch.dtype) -> bool:
    """Whether a call of `rows` rows of `dtype` on blocks with an AMX copy runs the AMX matmul."""
    return dtype == torch.bfloat16 and AMX_MIN_TOKENS <= rows <= AMX_MAX_TOKENS


def amx_order(
    kind: str, qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMV blocks (`GemvBlocks`, the GGUF's order; N a multiple of 16) in the AMX matmuls'
    layout (kernels/cpu_ext_amx.py): (qa, sa). Tile row r of output block b and group g holds the
    pairs k = 32 g + 2 r, 2 r + 1 of outputs 16 b .. 16 b + 7 in its first half and of outputs
    16 b + 8 .. 16 b + 15 in its second (int4: low and high nibbles of the same 16 bytes)."""
    n, g = scale.shape
    nb = n // 16
    if kind == "int4":
        b = qs.view(n, g, 16)
        values = torch.cat([b & 15, b >> 4], dim=2)  # [N, G, 32]: q[n, 32 g + j]
        q = values.view(nb, 2, 8, g, 16, 2)  # block, half, output, group, row, pair
        qa = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(nb, g, 16, 16)
        parts = [scale, offset]
    else:
        q = qs.view(nb, 2, 8, g, 16, 2)
        qa = q.permute(0, 3, 4, 1, 2, 5).reshape(nb, g, 16, 32)
        parts = [scale]
    sa = torch.cat([p.view(nb, 16, g).permute(0, 2, 1) for p in parts], dim=2)
    return qa.contiguous(), sa.float().contiguous()


def q8_0_block_order(qs: torch.Tensor) -> torch.Tensor:
    """Q8_0 weights int8 [N, K] from the GGUF's order into the kernel's block order: for each full
    block of 16 groups, 16 chunks of 32 bytes, byte i of chunk c holding element 2 c + i % 2 of
    the block's group i // 2, so that a chunk widens into int16 pairs that each belong to one
    group (kernels/cpu_ext_quant.py); the last G % 16 groups as they were."""
    n, k = qs.shape
    full = k // GROUP_SIZE // Q8_0_BLOCK_GROUPS * Q8_0_BLOCK_GROUPS
    b = qs[:, : full * GROUP_SIZE].reshape(n, -1, Q8_0_BLOCK_GROUPS, GROUP_SIZE // 2, 2)
    blocks = b.permute(0, 1, 3, 2, 4).reshape(n, -1)  # [N, block, chunk c, group, element t]
    return torch.cat([blocks, qs[:, full * GROUP_SIZE :]], dim=1).contiguous()


@functools.cache
def int4_kernel_block_groups() -> int:
    """The int4 weight order the built C++ GEMV reads: 8 (`int4_block_order`) where it was built
    for AVX2 without AVX-512BW, 1 (the GGUF's) elsewhere."""
    return int(torch.ops.laneserve.int4_gemv_block_groups())


def int4_block_order(qs: torch.Tensor) -> torch.Tensor:
    """int4 weights uint8 [N, K/2] from the GGUF's nibble order (byte 16 g + j: elements j and
    16 + j of group g) into the kernel's block order: for each full block of 8 groups, 8 chunks
    of 16 bytes, byte i of chunk c holding element 2 c + i % 2 of the block's group i // 2 in its
    low nibble and element 2 (c + 8) + i % 2 in its high one, so that a chunk unpacks into lanes
    that each belong to one group (kernels/cpu_ext_quant.py); the last G % 8 groups as they
    were."""
    n, half = qs.shape
    groups = half // (GROUP_SIZE // 2)
    full = groups // INT4_BLOCK_GROUPS * INT4_BLOCK_GROUPS
    b = qs[:, : full * GROUP_SIZE // 2].reshape(n, full, GROUP_SIZE // 2)
    q = torch.cat([b & 15, b >> 4], dim=2)  # [N, full, 32] in element order
    q = q.reshape(n, full // INT4_BLOCK_GROUPS, INT4_BLOCK_GROUPS, GROUP_SIZE // 2, 2)
    q = q.permute(0, 1, 3, 2, 4).reshape(n, -1, GROUP_SIZE // 2, 2 * INT4_BLOCK_GROUPS)
    chunks = GROUP_SIZE // 4  # element pairs (k) 0..7 in the low nibbles, 8..15 in the high
    blocks = q[:, :, :chunks] | (q[:, :, chunks:] << 4)  # [N, blocks, chunk c, byte i]
    return torch.cat([blocks.reshape(n, -1), qs[:, full * GROUP_SIZE // 2 :]], dim=1).contiguous()


# --------------------------------------------------------------------------- linears


INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0
KERNEL_DTYPE = torch.bfloat16  # torch's int4/int8 CPU kernels are vectorized for bf16 only
# From this many rows up, a dense bf16 GEMM beats the int4 kernel. With the dense copy packed
# (`pack_dense`) on a 2-core EPYC with AVX512-BF16, 2 threads: per linear
# (scripts/bench_quant.py, medians of per-round ratios) the crossovers are qkv 8, o 12,
# gate_up 12, down 8, lm_head 12; whole bf16 SmolLM2 decode steps (context 150-300, dense vs
# int4 alternating step by step) take 15.6 vs 14.2 ms at 8 rows, 17.1 vs 19.1 at 10, 21.5 vs
# 24.8 at 12. (Unpacked, at 1 thread, the per-linear crossovers were 8-32 rows: 16 then.)
# Only used when the activations are bf16/fp16 on a CPU with native bf16 (`dense_copy_dtype`):
# on an AVX2-only CPU a dense bf16 GEMM is 2-7x slower than the int4 kernel at every M measured.
DENSE_MIN_TOKENS = 10
# float32 activations (an AVX2-only CPU's `dtype="auto"`): up to GEMV_MAX_TOKENS rows run the
# C++ GEMVs (kernels/cpu_ext_quant.py: the GGUF's exact weights, activations rounded to int16
# per 32-element group), from DENSE_MIN_TOKENS_FP32 rows a dense float32 GEMM on a float32 copy.
# Measured on a 2-core EPYC with AVX2/FMA/F16C only (scripts/bench_quant.py, 2 threads, dense
# float32 time / GEMV time per shape): at 1 row 2.2-6.5, 8 rows 2.2-6.5, 16 rows 1.3-3.1,
# 32 rows 1.07-2.1, 40 rows 0.99-1.35, 48 rows 1.01-1.18, 56 rows 0.93-1.09, 64 rows 0.85-1.04
# (the LM head 1.4 at 64). With float32 activations in the GEMVs (before 3 December 2026) the
# crossover was 32 rows. Since the int4 GEMV reads its weights in blocks of 8 groups on AVX2
# (December 2026), on a 2-core Zen 2 EPYC (AVX2 only, 3.3 GHz) the per-linear crossovers are
# qkv and o 48, down 80, gate_up 96 rows (the Q8_0 LM head: about 128), and whole float32 decode
# steps of SmolLM2 (thresholds switched step by step on one engine, medians of 8) took 147 vs
# 180 ms at 48 rows with the GEMVs, 184 vs 218 at 64, 232 vs 259 at 80, 283-284 either way at 96.
# Where the int4 GEMV keeps the GGUF order (an AVX-512BW build's pair loop, `int4_blocked_cpu`
# False) the threshold stays the one measured before the block order.
DENSE_MIN_TOKENS_FP32 = 96
DENSE_MIN_TOKENS_FP32_GGUF_ORDER = 48
# A tied Q8_0 LM head (`QuantLinear.read_q8_0_blocks`) runs float32 calls on its dense copy
# only from this many rows where the int4 GEMV reads the block order (measured there): its GEMV
# took 0.55-0.75x the dense GEMM's time up to 96 rows and about as long at 128 on that EPYC.
Q8_0_HEAD_DENSE_MIN_TOKENS_FP32 = 128
GEMV_MAX_TOKENS = DENSE_MIN_TOKENS_FP32 - 1


def int4_blocked_cpu() -> bool:
    """Whether this CPU's build of the C++ int4 GEMV reads the block order (AVX2 without
    AVX-512BW: `int4_kernel_block_groups` is 8 there), from the CPU flags the ``-march=native``
    build follows, so routing can be chosen before the kernels are built."""
    from laneserve.gpu_worker.engine import cpu_flags  # lazy: engine imports the model code

    flags = cpu_flags()
    return "avx2" in flags and not {"avx512f", "avx512bw"} <= flags


def _padded_for_packing(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N', K], scale_zeros [K/32, N', 2] in the kernel dtype) with N padded to a multiple of
    16 (the packers' requirement) by all-zero rows ((8 - 8) * 0 + 0) that the output drops."""
    pad = -groups.q.shape[0] % INT4_N_MULTIPLE
    q, scale, zero = groups.q, groups.scale, groups.zero
    if pad:
        q = F.pad(q, (0, 0, 0, pad), value=8)
        scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
    scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1)
    return q, scale_zeros.to(KERNEL_DTYPE).contiguous()


def cuda_inner_k_tiles(k: int) -> int:
    """`inner_k_tiles` for `_convert_weight_to_int4pack` on CUDA: the largest of 8, 4, 2 with
    K divisible by 16 x tiles (SmolLM2's K = 576 takes 4).

    Raises:
        ValueError: K not a multiple of 32.
    """
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"K={k} is not a multiple of 32: no CUDA int4 packing")


def dense_copy_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the dense copy kept for large-M calls, or None for no copy.

    float32 activations keep a float32 copy (large calls on oneDNN's float32 GEMM, see
    DENSE_MIN_TOKENS_FP32); bf16/fp16 ones a copy in their dtype only on a CPU with AMX or
    AVX512-BF16, where those GEMMs beat the int4 kernel from DENSE_MIN_TOKENS rows.
    """
    from laneserve.gpu_worker.engine import cpu_has_fast_bf16  # lazy: engine imports the model code

    if dtype == torch.float32 or cpu_has_fast_bf16():
        return dtype
    return None


# bf16 calls of fewer rows than this skip the bf16 GEMV: int4 ones run torch's int4 kernel, Q8_0
# ones the int16 path (the kernel's own threshold, `kBf16GemvMinRows`). The bf16 GEMV reads 24 bytes
# per 32 weights (torch's kernel 20) and dequantizes every group, so at 1-4 rows, where torch's
# kernel unpacks its weights in one 4-row pass, whole bf16 SmolLM2 decode steps took 1.11-1.18x as
# long with it; at 5 rows (a batch-1 speculative verification of 4 drafts; torch's kernel makes a
# second pass) 0.81-0.87x, at 8 rows 0.98-1.01x (a 2-core Zen 5 EPYC with AVX512-BF16,
# `scripts/bench_quant.py --steps --quantization auto,auto-nolayergemv`). The tied Q8_0 LM head
# alone: 800 vs 647 us at 1 row, 964 vs 1451 at 5, 1392 vs 2235 at 8.
BF16_GEMV_MIN_TOKENS = 5  # = kBf16GemvMinRows in kernels/cpu_ext_quant.py


# int4 calls of more rows than this (up to the dense copy's threshold) go back to torch's kernel:
# whole bf16 verification steps of one sequence (context 400, one process, interleaved) on a
# 2-core Zen 4 EPYC took 30.4 ms with the bf16 GEMV at 8 rows against 27.7 with torch's kernel
# (5 rows 22.2 vs 24.4, 6 rows 23.5 vs 24.9); on the Zen 5 of docs/benchmarks.md Run 9, 8 rows
# were 0.98-1.04x either way.
BF16_GEMV_MAX_TOKENS = 7
# A Q8_0 linear leaves the bf16 GEMV for the int16 path only when the bf16 one measures slower
# than this many times the int16 one (`QuantLinear.bf16_gemv_pays`; 1.5x faster on a Zen 5,
# ~3x slower on a Zen 4).
BF16_GEMV_SLOWER = 1.25


def bf16_takes_gemv(kind: str, rows: int) -> bool:
    """Whether a bf16 call of `rows` rows (at most `GEMV_MAX_TOKENS`) on GEMV blocks of `kind`
    runs the C++ GEMV rather than torch's kernel: Q8_0 blocks always (torch has no kernel for
    them; below `BF16_GEMV_MIN_TOKENS` rows the kernel reads bf16 rows exactly into its int16
    path, from there `QuantLinear` measures which path pays), int4 ones from
    `BF16_GEMV_MIN_TOKENS` to `BF16_GEMV_MAX_TOKENS` rows. One int4 row through the int16 path
    (its groups unpacked in pairs, no shuffle) took 0.89-0.93x the time of torch's int4 kernel
    over SmolLM2's 120 layer linears in a loop, but whole batch-1 decode steps 1.01-1.02x (2-core
    Zen 4 EPYC, `scripts/bench_quant.py --steps --quantization auto,auto-nolayergemv`, either
    OpenMP wait policy), so that row stays on torch's kernel."""
    return kind == "q8_0" or BF16_GEMV_MIN_TOKENS <= rows <= BF16_GEMV_MAX_TOKENS


def gemv_takes_bf16() -> bool:
    """Whether a bf16 model's int4 and Q8_0 linears get GEMV blocks, about 0.75 bytes per weight
    beside torch's int4 pack and the dense copy (SmolLM2's weights 396 -> 475 MB; on an AMX CPU
    the AMX copies, `amx_order`, add ~0.75 bytes per weight more: 504 -> 615 MB). On a CPU with
    AVX512-BF16 the kernel converts each weight group to bf16 once and runs one vdpbf16ps per
    group and row, so extra rows cost little (`BF16_GEMV_MIN_TOKENS` rows up: 5-row calls of the
    SmolLM2 linears took 0.47-0.74x the time of torch's int4 kernel, scripts/bench_quant.py;
    Q8_0 linears' fewer rows then run the int16 path instead of torch's int8 kernel). Elsewhere
    bf16 int4 calls stay on torch's kernel. The CPU flag decides, read at load time, when the
    extension may still be building; its ``-march=native`` build compiles the bf16 path for
    exactly these CPUs."""
    from laneserve.gpu_worker.engine import cpu_flags  # lazy: engine imports the model code

    return "avx512_bf16" in cpu_flags()


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


class QuantLinear:
    """`y = x @ W.T` with W held as weight-only int4 (group 32) or int8 (per channel).

    The kernels take bf16 activations: float32 inputs are rounded to bf16 on the way in and the
    result (accumulated in fp32 by the kernel) comes back as float32. Each output row depends on
    its input row only (no split-K by M), so results do not depend on the batch.

    Args:
        kind: "int4" or "int8".
        weight: int4: the packer's output for the weight's device (`from_int4`: CPU, uint8
            [N, K/2]; `from_int4_cuda`: `_convert_weight_to_int4pack`'s tiled int32); int8: [N, K].
        scales: int4: [K/32, N, 2] (scale, zero) bf16; int8: [N] bf16.
        shape: (N, K).
        dense: optional copy of W in the activation dtype, used for calls of at least
            `dense_min_tokens` rows (compute-bound prefill chunks and big decode batches); held
            packed (`pack_dense`), `dense` gives it back as a plain tensor.
        gemv: optional `GemvBlocks` of the same W, used for float32 calls (bf16 ones: from
            `BF16_GEMV_MIN_TOKENS` rows, Q8_0 blocks also below) of at most `gemv_max_tokens`
            rows when the C++ kernels are built (`kernels.cpu_ext`).
    """

    def __init__(
        self,
        kind: str,
        weight: torch.Tensor,
        scales: torch.Tensor,
        shape: tuple[int, int],
        dense: torch.Tensor | None = None,
        dense_min_tokens: int = DENSE_MIN_TOKENS,
        gemv: GemvBlocks | None = None,
        gemv_max_tokens: int = GEMV_MAX_TOKENS,
    ):
        assert kind in ("int4", "int8"), kind
        assert scales.dtype == KERNEL_DTYPE, scales.dtype
        self.kind = kind
        self.weight = weight
        self.scales = scales
        self.shape = shape
        self._dense = pack_dense(dense) if dense is not None else None
        self.dense_min_tokens = dense_min_tokens
        self.gemv = gemv
        self.gemv_max_tokens = gemv_max_tokens
        self._bf16_gemv_pays: bool | None = None  # Q8_0 blocks: measured (`bf16_gemv_pays`)

    @classmethod
    def from_int4(cls, groups: Int4Groups, **kwargs) -> QuantLinear:
        """Pack for the CPU kernel; N is padded to a multiple of 16 (the packer's requirement)
        with all-zero rows that the output drops."""
        q, scale_zeros = _padded_for_packing(groups)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        return cls("int4", packed, scale_zeros, tuple(groups.q.shape), **kwargs)

    @classmethod
    def from_int4_cuda(cls, groups: Int4Groups, device: torch.device) -> QuantLinear:
        """Pack for torch's CUDA int4 kernel (`_convert_weight_to_int4pack`: uint8 [N, K/2], two
        values per byte, the even column in the high nibble; N padded to a multiple of 16; the
        largest `inner_k_tiles` of 8/4/2 that divides K / 16)."""
        q, scale_zeros = _padded_for_packing(groups)
        tiles = cuda_inner_k_tiles(q.shape[1])
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        return cls("int4", packed, scale_zeros.to(device), tuple(groups.q.shape))

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, **kwargs) -> QuantLinear:
        return cls("int8", q.contiguous(), scale.to(KERNEL_DTYPE), tuple(q.shape), **kwargs)

    def bf16_gemv_pays(self, x: torch.Tensor) -> bool:
        """For Q8_0 blocks: whether bf16 calls of `BF16_GEMV_MIN_TOKENS` rows or more run the
        bf16 GEMV (else the int16 path, x read as float32: exact), decided once per linear on
        its first such call `x` by timing both, three times each, interleaved: the int16 path
        only when the bf16 one's median is more than `BF16_GEMV_SLOWER` times its own (a clear
        loss: where the two are close, every process keeps the bf16 GEMV, so outputs do not
        depend on a noisy measurement). The CPUs differ: on a 2-core Zen 5 EPYC the bf16 GEMV took
        964 vs 1451 us for the tied 49,152 x 576 LM head at 5 rows (docs/benchmarks.md Run 9); on a
        2-core Zen 4, whose 512-bit units are double-pumped, 4.3 vs ~1.3 ms, and whole 5-row
        verification steps 25.4 vs 22.2 ms (Run 10). The measurement runs six calls once (~20 ms for
        that head on the Zen 4), inside the step that makes the first such call. Below
        `BF16_GEMV_MIN_TOKENS` rows the kernel takes the int16 path anyway."""
        if x.shape[0] < BF16_GEMV_MIN_TOKENS:
            return True
        if self._bf16_gemv_pays is None:
            x = x.contiguous()
            xf = x.float()
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(3):
                for bf16 in (True, False):
                    t0 = time.perf_counter()
                    self.gemv(x) if bf16 else self.gemv(xf).to(x.dtype)
                    times[bf16].append(time.perf_counter() - t0)
            bf16_ms, int16_ms = (1e3 * statistics.median(times[k]) for k in (True, False))
            self._bf16_gemv_pays = bf16_ms <= BF16_GEMV_SLOWER * int16_ms
            logger.info(
                "Q8_0 GEMV %s at %d bf16 rows: bf16 path %.2f ms, int16 path %.2f ms: using the %s",
                tuple(self.shape), x.shape[0], bf16_ms, int16_ms,
                "bf16 path" if self._bf16_gemv_pays else "int16 path",
            )  # fmt: skip
        return self._bf16_gemv_pays

    def read_q8_0_blocks(self, blocks: GemvBlocks) -> None:
        """Run few-row calls of any dtype on `blocks` (the exact Q8_0 weights, e.g. a tied
        embedding's arrays) through the C++ GEMV: up to `gemv_max_tokens` rows, or every row
        count when no dense copy takes the large ones (the int8 weights are then used only
        without the C++ kernels). Where the kernel reads Q8_0 blocks of 16 groups, `blocks`
        get their block-order copy (`GemvBlocks.block_copy`)."""
        assert blocks.kind == "q8_0" and self.kind == "int8", (blocks.kind, self.kind)
        blocks.block_copy = True
        blocks.use_amx = self._dense is not None and self._dense.dtype == torch.bfloat16
        self.gemv = blocks
        if self._dense is None:
            self.gemv_max_tokens = sys.maxsize
        elif self._dense.dtype == torch.float32 and int4_blocked_cpu():
            self.dense_min_tokens = max(self.dense_min_tokens, Q8_0_HEAD_DENSE_MIN_TOKENS_FP32)
            self.gemv_max_tokens = self.dense_min_tokens - 1

    @property
    def dense(self) -> torch.Tensor | None:
        """The dense copy as a plain tensor (a new one when it is held packed), or None."""
        if self._dense is None or not self._dense.is_mkldnn:
            return self._dense
        return self._dense.to_dense()

    def nbytes(self) -> int:
        """Bytes held (quantized weight, scales, dense copy, GEMV blocks)."""
        tensors = (self.weight, self.scales, self._dense)
        held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return held + (self.gemv.nbytes() if self.gemv is not None else 0)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] with the kernel's (bf16) scales; int4 through the kernel itself
        (x = identity), so its values are rounded to bf16 on the way out."""
        if self.kind == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        eye = torch.eye(self.shape[1], dtype=KERNEL_DTYPE, device=self.weight.device)
        return self._kernel(eye).float().t().contiguous()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int4":
            mm = (
                torch.ops.aten._weight_int4pack_mm
                if self.weight.is_cuda
                else torch.ops.aten._weight_int4pack_mm_for_cpu
            )
            y = mm(x, self.weight, GROUP_SIZE, self.scales)
            # padded N: drop the zero rows, dense again for the C++ layer ops (kernels.step_ops)
            return y if y.shape[1] == self.shape[0] else y[:, : self.shape[0]].contiguous()
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if (
            self.gemv is not None
            and amx_takes(x.shape[0], x.dtype)
            and cpu_ext.load()
            and self.gemv.takes_amx(x)
        ):
            y = self.gemv(x.contiguous())
            return y if bias is None else y + bias
        if self._dense is not None and x.shape[0] >= self.dense_min_tokens:
            return dense_linear(x, self._dense, bias)
        y = None
        if self.gemv is not None and x.shape[0] <= self.gemv_max_tokens and cpu_ext.load():
            if x.dtype == torch.float32 or (
                x.dtype == torch.bfloat16
                and bf16_takes_gemv(self.gemv.kind, x.shape[0])
                and (self.gemv.kind != "q8_0" or self.bf16_gemv_pays(x))
            ):
                # in and out in x's dtype: no conversion dispatched (two `aten::to` per linear
                # were 240 of a batch-1 float32 step's ~570 top-level ops)
                y = self.gemv(x.contiguous())
            elif self.gemv.kind == "q8_0":  # fp16, or bf16 where it pays: the int16 path
                y = self.gemv(x.float().contiguous()).to(x.dtype)
        if y is not None:
            return y if bias is None else y + bias
        if x.dtype == KERNEL_DTYPE:
            y = self._kernel(x)
        else:
            y = self._kernel(x.to(KERNEL_DTYPE)).to(x.dtype)
        return y if bias is None else y + bias


class Q8Embedding:
    """An embedding table kept in GGUF Q8_0 blocks; lookups are exact (fp16 scale x int8).

    qs: int8 [V, K]; d: float32 [V, K / 32]. 1.06 bytes per weight instead of 2 (bf16) or 4.
    """

    def __init__(self, t: GGUFQuantTensor, dtype: torch.dtype):
        assert t.qtype == "Q8_0", t.qtype
        self.qs, self.d = q8_0_arrays(t)
        self.dtype = dtype

    def nbytes(self) -> int:
        return self.qs.numel() + self.d.numel() * 4

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> [T, K] in `dtype`."""
        t = ids.shape[0]
        qs = self.qs.index_select(0, ids).view(t, -1, GROUP_SIZE).float()
        return (qs * self.d.index_select(0, ids)[..., None]).view(t, -1).to(self.dtype)


def _as_float(part: torch.Tensor | GGUFQuantTensor) -> torch.Tensor:
    return dequantize(part) if isinstance(part, GGUFQuantTensor) else part.float()


def _auto_kind(parts: list) -> str | None:
    types = {p.qtype if isinstance(p, GGUFQuantTensor) else "float" for p in parts}
    if types <= {"Q4_0", "Q4_1"}:
        return "int4"
    if types == {"Q8_0"}:
        return "int8"
    return None


def build_is_dense(parts: list[torch.Tensor | GGUFQuantTensor], mode: str) -> bool:
    """Whether `build_linear` returns a plain dense tensor for these parts in this mode."""
    return mode == "none" or (mode == "auto" and _auto_kind(parts) is None)


def build_linear(
    name: str,
    parts: list[torch.Tensor | GGUFQuantTensor],
    mode: str,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor | QuantLinear:
    """One (fused) linear from its row blocks `parts` ([N_i, K] each, concatenated along N).

    `none`, or `auto` over float weights: a dense tensor in `dtype`. `auto` over GGUF blocks: int4
    for Q4_0 / Q4_1 (exact), int8 per channel for Q8_0 (requantized). `int4` / `int8`: that kernel
    for any source (round-to-nearest from float). A dense copy of the source weights rides along
    for large-M calls where it is faster (`dense_copy_dtype`); a float32 model also gets
    `GemvBlocks` (the exact GGUF values; Q8_0 ones only from Q8_0 sources) for few-row calls, and
    so does a bf16 one where `gemv_takes_bf16` (a tied LM head over a Q8_0 embedding gets them in
    any dtype: `QuantLinear.read_q8_0_blocks`).
    On a CUDA `device` (mode `int4`, `resolve_mode`) the int4 weight is packed for the CUDA
    kernel there, with no copies beside it. A dense result stays on the CPU (the caller moves it).
    """
    if (
        mode == "auto"
        and _auto_kind(parts) is None
        and any(isinstance(p, GGUFQuantTensor) for p in parts)
    ):
        logger.info("%s: mixed GGUF types across fused parts; dequantized instead", name)
    if build_is_dense(parts, mode):
        return torch.cat([_as_float(p) for p in parts]).to(dtype).contiguous()
    kind = _auto_kind(parts) if mode == "auto" else mode
    if device is not None and device.type == "cuda":
        if kind != "int4":
            raise ValueError(f"{name}: only int4 has a CUDA kernel here, not {kind}")
        return QuantLinear.from_int4_cuda(_int4_groups(parts), device)
    dense_dtype = dense_copy_dtype(dtype)
    gemv = None
    with_gemv = dtype == torch.float32 or (dtype == torch.bfloat16 and gemv_takes_bf16())
    if kind == "int4":
        groups = _int4_groups(parts)
        dense = groups.dequantize().to(dense_dtype) if dense_dtype else None
        if with_gemv:
            gemv = GemvBlocks.from_int4(groups)
            gemv.use_amx = dtype == torch.bfloat16
        return QuantLinear.from_int4(groups, **_routes(dtype, dense, gemv))
    weight = torch.cat([_as_float(p) for p in parts])
    dense = weight.to(dense_dtype) if dense_dtype else None
    if with_gemv and all(_is_q8_0(p) for p in parts):
        gemv = GemvBlocks.from_q8_0(parts)  # the Q8_0 blocks themselves: exact weights
        gemv.use_amx = dtype == torch.bfloat16
    return QuantLinear.from_int8(*int8_from_float(weight), **_routes(dtype, dense, gemv))


def _int4_groups(parts: list[torch.Tensor | GGUFQuantTensor]) -> Int4Groups:
    """Q4_0 / Q4_1 blocks exactly, anything else rounded to the nearest int4 (group 32)."""
    return Int4Groups.cat(
        [
            int4_from_gguf(p)
            if isinstance(p, GGUFQuantTensor) and p.qtype != "Q8_0"
            else int4_from_float(_as_float(p))
            for p in parts
        ]
    )


def _routes(dtype: torch.dtype, dense: torch.Tensor | None, gemv: GemvBlocks | None) -> dict:
    threshold = dense_min_tokens(dtype)
    routes = {"dense": dense, "dense_min_tokens": threshold, "gemv": gemv}
    if dtype == torch.float32:  # below the copy's threshold, every float32 call on the GEMV
        routes["gemv_max_tokens"] = threshold - 1
    return routes


def _is_q8_0(part: torch.Tensor | GGUFQuantTensor) -> bool:
    return isinstance(part, GGUFQuantTensor) and part.qtype == "Q8_0"


def build_embedding(
    table: torch.Tensor | GGUFQuantTensor, mode: str, dtype: torch.dtype
) -> torch.Tensor | Q8Embedding:
    """The token embedding: Q8_0 blocks stay quantized (exact lookups) unless `mode == "none"`."""
    if mode != "none" and isinstance(table, GGUFQuantTensor) and table.qtype == "Q8_0":
        return Q8Embedding(table, dtype)
    return _as_float(table).to(dtype).contiguous()


def embedding(ids: torch.Tensor, table: torch.Tensor | Q8Embedding) -> torch.Tensor:
    """F.embedding for a dense table, the Q8_0 lookup for a `Q8Embedding`."""
    if isinstance(table, Q8Embedding):
        return table(ids)
    return F.embedding(ids, table)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantLinear, bias=None) -> torch.Tensor:
    """F.linear for a dense weight, the quantized kernel for a `QuantLinear`."""
    if isinstance(weight, QuantLinear):
        return weight(x, bias)
    return F.linear(x, weight, bias)


def nbytes(obj: torch.Tensor | QuantLinear | Q8Embedding | None) -> int:
    """Bytes held by a weight of any of the forms above."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return obj.nbytes()
