"""Weight-only quantized linears (int4 group-32, Q8_0 blocks, int8 per-channel) for the CPU.

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
  (kernels/csrc/amx_matmul.cpp: each 16-output x 32-input weight tile dequantized once to bf16 for
  all the rows of x, so 5 rows cost about what 1 does and a 512-token prefill reads 4-bit
  weights instead of the bf16 copy), ahead of the bf16 GEMV and the dense copy.
- float32 activations (`dtype="auto"` on a CPU without native bf16): below `dense_min_tokens`
  rows the C++ GEMVs (kernels/csrc/quant_gemv.cpp) read the GGUF's values (int4 ones reordered once
  into blocks of 8 groups where the kernel was built for AVX2 without AVX-512BW,
  `int4_block_order`), each activation row rounded to 16-bit
  integers per 32-element group for integer dot products (~3e-5 relative to float32
  activations; bf16 rounding is ~4e-3); from `dense_min_tokens(torch.float32)` rows (96 with the
  block order, 48 otherwise) a dense float32 copy
  (4 bytes per weight) runs oneDNN's GEMM on the activations as they are. Both use the exact GGUF
  values, so kernel switches change outputs by that rounding and float32 summation order only.
- A model whose Q8_0 linears' dense copies would pass `DENSE_COPY_MAX_BYTES` (1 GiB; a
  Llama-3.2-1B shape's: 4.7 GB in float32) keeps none (`dense_copies_fit`): their calls past the
  GEMV's rows dequantize tiles of `KQUANT_TILE_ROWS` outputs for the same dense GEMM
  (`kquant.tiled_linear`; 0.85-1.3x the copy's time at 96-2,048 rows on a 2-core AVX2 EPYC,
  1B shapes), as K-quant linears do, and the model holds ~1.06 bytes per Q8_0 weight.

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
at one row, its int4 GEMV 0.47-0.61x). The per-channel int8 copy of Q8_0 weights is the path
without the C++ kernels, made on the first call that needs it (`QuantLinear`); requantizing Q8_0
to int4 would cost ~8x the int8 error.

Kernels (torch CPU, ATen):

- `_weight_int4pack_mm_for_cpu(x [M, K], packed [N, K/2] uint8, 32, scale_zeros [K/32, N, 2])`
  computes `x @ W.T` with `W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`, `g = k // 32`,
  `q` in 0..15 (torch's convention, checked in tests/kernels/test_kernels_quant.py). GGUF Q4_1
  (`w = d * q + m`) maps exactly with scale = d, zero = m + 8 d; Q4_0 (`w = d * (q - 8)`) with
  scale = d, zero = 0.
- `_weight_int8pack_mm(x [M, K], q [N, K] int8, scale [N])` computes `x @ (q * scale[:, None]).T`.
  GGUF Q8_0 (32-element blocks with their own fp16 scale) has no exact kernel; it is requantized
  per output channel (symmetric, max-abs / 127).

The GGUF blocks and their unpacked forms are gpu_worker/gguf_blocks.py; the C++ GEMV and AMX
kernels' weight layouts (`GemvBlocks`) gpu_worker/gemv_blocks.py; the dense copies'
gpu_worker/dense_copies.py; Q8_0 embeddings gpu_worker/quant_embedding.py. This module holds the
modes, the routing thresholds, `QuantLinear` and the builders the model calls.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

from laneserve.contracts import env
from laneserve.gpu_worker import kquant
from laneserve.gpu_worker.config import QUANTIZATIONS as QUANTIZATION_MODES
from laneserve.gpu_worker.dense_copies import (  # noqa: F401 (re-exported)
    dense_copies_fit,
    dense_copy_dtype,
    dense_linear,
    dense_min_tokens,
    int4_blocked_cpu,
    pack_dense,
)
from laneserve.gpu_worker.gemv_blocks import GemvBlocks, amx_takes, gemv_takes_bf16
from laneserve.gpu_worker.gguf_blocks import (
    GROUP_SIZE,
    GGUFQuantTensor,
    Int4Groups,
    dequantize,
    int4_from_float,
    int4_from_gguf,
    int8_from_float,
)
from laneserve.gpu_worker.kernel_routes import (  # noqa: F401 (re-exported: the routes' names)
    BF16_DENSE_GEMV_MAX_TOKENS,
    BF16_GEMV_MAX_TOKENS,
    BF16_GEMV_MIN_TOKENS,
    BF16_GEMV_SLOWER,
    DENSE_COPY_MAX_BYTES,
    DENSE_MIN_TOKENS,
    DENSE_MIN_TOKENS_FP32,
    DENSE_MIN_TOKENS_FP32_GGUF_ORDER,
    GEMV_MAX_TOKENS,
    Q8_0_HEAD_DENSE_MIN_TOKENS_FP32,
)
from laneserve.gpu_worker.quant_embedding import (  # noqa: F401 (re-exported)
    Q8Embedding,
    build_embedding,
    embedding,
)
from laneserve.kernels import cpu_ext

logger = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------- linears


INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0
KERNEL_DTYPE = torch.bfloat16  # torch's int4/int8 CPU kernels are vectorized for bf16 only


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


class QuantLinear:
    """`y = x @ W.T` with W held as weight-only int4 (group 32) or int8 (Q8_0 blocks, per channel).

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
        tiled: Q8_0 blocks in `gemv` and no dense copy (the model's would not fit, see
            `dense_copies_fit`): calls of `tile_min_tokens` rows or more run dense GEMMs on
            dequantized tiles of W (`kquant.tiled_linear`), as K-quant linears do.

    Built from Q8_0 blocks (`from_q8_0_blocks`), `weight` and `scales` (torch's int8 kernel's
    per-channel requantization) are made by the first call without the C++ kernels (not built
    yet, or off): a model served on them never holds that copy (1 byte per weight).
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
        tiled: bool = False,
    ):
        assert kind in ("int4", "int8"), kind
        assert scales is None or scales.dtype == KERNEL_DTYPE, scales.dtype
        lazy = weight is None and gemv is not None and gemv.kind == "q8_0"
        assert (weight is not None and scales is not None) or lazy, "weights or Q8_0 blocks"
        assert not tiled or (dense is None and gemv is not None and gemv.kind == "q8_0"), "tiles"
        self.kind = kind
        self._weight = weight
        self._scales = scales
        self.shape = shape
        self._dense = pack_dense(dense) if dense is not None else None
        self.dense_min_tokens = dense_min_tokens
        self.gemv = gemv
        self.gemv_max_tokens = gemv_max_tokens
        self.tiled = tiled
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

    @classmethod
    def from_q8_0_blocks(cls, gemv: GemvBlocks, **kwargs) -> QuantLinear:
        """An int8 linear over Q8_0 blocks (exact), its per-channel int8 weights made on first
        need (the class docstring)."""
        return cls("int8", None, None, tuple(gemv.qs.shape), gemv=gemv, **kwargs)

    @property
    def tile_min_tokens(self) -> int:
        """From how many rows a `tiled` linear's calls run on tiles: past its GEMV's rows."""
        return max(self.dense_min_tokens, self.gemv_max_tokens + 1)

    @property
    def weight(self) -> torch.Tensor:
        """The weight torch's kernel reads (int4 pack or int8 per channel; module docstring)."""
        if self._weight is None:
            self._requantize()
        return self._weight

    @property
    def scales(self) -> torch.Tensor:
        """The scales (and zeros) torch's kernel reads with `weight`."""
        if self._scales is None:
            self._requantize()
        return self._scales

    def _requantize(self) -> None:
        """Make the per-channel int8 weights from the Q8_0 blocks (the class docstring), a tile
        of rows at a time (each row is its own channel: the same as all at once)."""
        with _REQUANTIZE_LOCK:
            if self._weight is None:
                n, rows = self.shape[0], kquant.KQUANT_TILE_ROWS
                tiles = [
                    int8_from_float(self.gemv.dequantize_rows(r, min(n, r + rows)))
                    for r in range(0, n, rows)
                ]
                self._scales = torch.cat([s for _, s in tiles]).to(KERNEL_DTYPE)
                self._weight = torch.cat([q for q, _ in tiles])

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
        bf16 = self._dense is not None and self._dense.dtype == torch.bfloat16
        blocks.use_amx = bf16 or (self.tiled and self.gemv.use_amx)
        # float32 routes: every call below the dense threshold on the GEMV (`_routes`)
        fp32 = self.gemv_max_tokens < self.dense_min_tokens
        self.gemv = blocks
        if self._dense is None and not self.tiled:
            self.gemv_max_tokens = sys.maxsize
        elif fp32 and int4_blocked_cpu():
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
        tensors = (self._weight, self._scales, self._dense)
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

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, rows: int | None = None
    ) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype. `rows`: route the call as one of that many rows
        (a part of a bigger call, cut for a pause, takes the whole's kernel: `llama.gate_up`)."""
        n = x.shape[0] if rows is None else rows
        if (
            self.gemv is not None
            and amx_takes(n, x.dtype)
            and cpu_ext.load()
            and self.gemv.takes_amx(x)
        ):
            y = self.gemv(x.contiguous())
            return y if bias is None else y + bias
        if self._dense is not None and n >= self.dense_min_tokens:
            return dense_linear(x, self._dense, bias)
        if self.tiled and n >= self.tile_min_tokens:
            return kquant.tiled_linear(x, self.shape[0], self.gemv.dequantize_rows, bias)
        y = None
        if self.gemv is not None and n <= self.gemv_max_tokens and cpu_ext.load():
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


_REQUANTIZE_LOCK = threading.Lock()


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
    dense_copies: bool = True,
    q8_0_blocks: GemvBlocks | None = None,
) -> torch.Tensor | QuantLinear:
    """One (fused) linear from its row blocks `parts` ([N_i, K] each, concatenated along N).

    `none`, or `auto` over float weights: a dense tensor in `dtype`. `auto` over GGUF blocks: int4
    for Q4_0 / Q4_1 (exact), int8 for Q8_0 (its blocks; requantized per channel for torch's
    kernel: made on need where GEMV blocks are kept). `int4` / `int8`: that kernel
    for any source (round-to-nearest from float). A dense copy of the source weights rides along
    for large-M calls where it is faster (`dense_copy_dtype`); a float32 model also gets
    `GemvBlocks` (the exact GGUF values; Q8_0 ones only from Q8_0 sources) for few-row calls, and
    so does a bf16 one where `gemv_takes_bf16` (a tied LM head over a Q8_0 embedding gets them in
    any dtype: `QuantLinear.read_q8_0_blocks`). Q8_0 ones with GEMV blocks make their int8 copy
    on need (`QuantLinear`), and keep no dense copy unless `dense_copies` (`dense_copies_fit`).
    `q8_0_blocks`: the parts' Q8_0 arrays where the caller holds them (a tied head: the embedding's).
    On a CUDA `device` (mode `int4`, `resolve_mode`) the int4 weight is packed for the CUDA
    kernel there, with no copies beside it. A dense result stays on the CPU (the caller moves it).
    """
    if kquant.runs(parts, mode, device):
        return kquant.KQuantLinear(parts)  # Q4_K / Q5_K / Q6_K on their own blocks (CPU)
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
    if with_gemv and all(isinstance(p, GGUFQuantTensor) and p.qtype == "Q8_0" for p in parts):
        # the Q8_0 blocks themselves (exact weights), or the same arrays already held
        gemv = q8_0_blocks or GemvBlocks.from_q8_0(parts)
        gemv.use_amx = dtype == torch.bfloat16
        tiled = dense_dtype is not None and not dense_copies
        dense = None
        if dense_dtype is not None and not tiled:
            dense = gemv.dequantize_rows(0, gemv.qs.shape[0]).to(dense_dtype)
        lin = QuantLinear.from_q8_0_blocks(tiled=tiled, **_routes(dtype, dense, gemv))
        if not env.get("LANESERVE_CPU_KERNELS"):
            lin.weight  # noqa: B018 (torch's kernel serves every call: made now, not mid-step)
        return lin
    weight = torch.cat([_as_float(p) for p in parts])
    dense = weight.to(dense_dtype) if dense_dtype and dense_copies else None
    return QuantLinear.from_int8(*int8_from_float(weight), **_routes(dtype, dense, gemv))


def _int4_groups(parts: list[torch.Tensor | GGUFQuantTensor]) -> Int4Groups:
    """Q4_0 / Q4_1 blocks exactly, anything else rounded to the nearest int4 (group 32)."""
    return Int4Groups.cat(
        [
            int4_from_gguf(p)
            if isinstance(p, GGUFQuantTensor) and p.qtype in ("Q4_0", "Q4_1")
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


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantLinear, bias=None, rows: int | None = None
) -> torch.Tensor:
    """F.linear for a dense weight, the quantized kernel for a `QuantLinear` / `KQuantLinear`;
    a decode-sized call on a dense bf16 CPU weight runs laneserve's bf16 GEMV (`takes_bf16_gemv`).
    `rows`: a `QuantLinear` picks its kernel as for a call of that many rows (the others' routes
    change only at 64 rows or fewer, under any part `rows` is given for)."""
    if isinstance(weight, QuantLinear):
        return weight(x, bias, rows)
    if not isinstance(weight, torch.Tensor):
        return weight(x, bias)
    if bias is None and takes_bf16_gemv(x, weight):
        return torch.ops.laneserve.bf16_gemv(x, weight)
    return F.linear(x, weight, bias)


def takes_bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs a dense call through kernels/csrc/bf16_gemv.cpp instead of `F.linear`:
    bf16 rows and a plain contiguous bf16 CPU weight, 1 to `BF16_DENSE_GEMV_MAX_TOKENS` rows, the
    C++ kernels loaded. Float32 models (the parity tests') never take it."""
    return (
        weight.dtype == torch.bfloat16
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and 0 < x.shape[0] <= BF16_DENSE_GEMV_MAX_TOKENS
        and weight.device.type == "cpu"
        and weight.layout == torch.strided
        and weight.is_contiguous()
        and cpu_ext.load()
    )


def nbytes(obj: torch.Tensor | QuantLinear | Q8Embedding | None) -> int:
    """Bytes held by a weight of any of the forms above."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return obj.nbytes()
