"""K-quant GGUF weights (Q4_K, Q5_K, Q6_K) executed on their own 256-weight super-blocks.

A `KQuantLinear` holds the super-blocks of each (fused) part as the file ships them (a view of
the mapped file where the loader did not have to permute the rows), so memory is about the file
size. Calls of at most `KQUANT_Q8K_MAX_TOKENS[qtype]` rows (decode, speculative verification,
small batches) run the int8 GEMV (``torch.ops.laneserve.kquant_gemv_q8k``,
kernels/csrc/kquant_q8k.cpp: the activations quantized once per call to llama.cpp's Q8_K, int8
per 256 with a float scale, and integer dot products with the weights' own quants on the
AVX-512 VNNI, AVX2 or scalar route the build has; ~0.4 % of a block's largest activation of
rounding per element, as llama.cpp). ``LANESERVE_KQUANT_INT8=0`` keeps the activations exact:
calls of at most `KQUANT_GEMV_MAX_TOKENS[qtype]` rows then run the fp32 GEMV
(``torch.ops.laneserve.kquant_gemv``, kernels/csrc/kquant_gemv.cpp: each super-block unpacked
once to float32 for all rows, fp32 dot products on the AVX-512 or AVX2 route the build has);
larger calls (prefill chunks, big batches) dequantize `KQUANT_TILE_ROWS` outputs at a time and run
the dense float32 GEMM on each tile, so no dense copy outlives the call. Without the C++ kernels
(not built yet, or ``LANESERVE_CPU_KERNELS=0``) every call takes the tile route, dequantized by the
`gguf` package. Activations of any dtype are computed in float32 and the result rounded once to
their dtype. A `KQuantEmbedding` dequantizes only the looked-up rows.

On CUDA K-quant weights are dequantized at load as before (`quantization.build_linear`).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from laneserve.contracts import env
from laneserve.gpu_worker.gguf_blocks import K_QUANT_TYPES, GGUFQuantTensor, dequantize
from laneserve.gpu_worker.kernel_routes import (  # noqa: F401 (re-exported)
    KQUANT_GEMV_MAX_TOKENS,
    KQUANT_Q8K_MAX_TOKENS,
)
from laneserve.kernels import cpu_ext

QTYPE_IDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml's type numbers, the kernel's `qtype`
QK_K = 256  # weights per super-block
KQUANT_TILE_ROWS = 512  # outputs dequantized at a time on the GEMM route (512 x 2048 x 4 = 4 MiB)


def is_kquant(part: torch.Tensor | GGUFQuantTensor) -> bool:
    return isinstance(part, GGUFQuantTensor) and part.qtype in K_QUANT_TYPES


def _blocks_tensor(t: GGUFQuantTensor) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view of the mapped file: the kernels only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(t.blocks))


def runs(parts: list, mode: str, device: torch.device | None) -> bool:
    """Whether `quantization.build_linear` makes a `KQuantLinear` of these parts: all K-quant,
    mode "auto", on the CPU."""
    on_cpu = device is None or device.type == "cpu"
    return mode == "auto" and on_cpu and all(map(is_kquant, parts))


class KQuantLinear:
    """`y = x @ W.T` with W = cat of K-quant parts [N_i, K] along N, each kept in its blocks."""

    def __init__(self, parts: list[GGUFQuantTensor]):
        assert parts and all(is_kquant(p) for p in parts), [p.qtype for p in parts]
        ks = {p.shape[1] for p in parts}
        assert len(ks) == 1, ks
        self.parts = parts
        self.blocks = [_blocks_tensor(p) for p in parts]
        self.qtypes = [QTYPE_IDS[p.qtype] for p in parts]
        self.shape = (sum(p.shape[0] for p in parts), ks.pop())

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] (exact: the GGUF's values)."""
        return torch.cat([self._tile(i, 0, p.shape[0]) for i, p in enumerate(self.parts)])

    def _tile(self, i: int, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 of part i as float32."""
        blocks = self.blocks[i][r0:r1]
        if cpu_ext.load():
            return torch.ops.laneserve.kquant_dequantize(blocks, self.qtypes[i])
        p = self.parts[i]
        return dequantize(GGUFQuantTensor(p.name, p.qtype, blocks.numpy(), (r1 - r0, p.shape[1])))

    def _gemm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        n = self.parts[i].shape[0]
        tiles = [
            F.linear(x, self._tile(i, r0, min(n, r0 + KQUANT_TILE_ROWS)))
            for r0 in range(0, n, KQUANT_TILE_ROWS)
        ]
        return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)

    def _part(self, xf: torch.Tensor, i: int) -> torch.Tensor:
        """Part i of `xf @ W.T` on the route for its row count (module docstring)."""
        rows, qtype = xf.shape[0], self.parts[i].qtype
        if cpu_ext.load():
            if env.get("LANESERVE_KQUANT_INT8") and rows <= KQUANT_Q8K_MAX_TOKENS[qtype]:
                return torch.ops.laneserve.kquant_gemv_q8k(xf, self.blocks[i], self.qtypes[i], 0)
            if rows <= KQUANT_GEMV_MAX_TOKENS[qtype]:
                return torch.ops.laneserve.kquant_gemv(xf, self.blocks[i], self.qtypes[i], 0)
        return self._gemm(xf, i)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        xf = x.float().contiguous()
        ys = [self._part(xf, i) for i in range(len(self.parts))]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


class KQuantEmbedding:
    """An embedding table kept in K-quant super-blocks; a lookup dequantizes its rows (exact)."""

    def __init__(self, t: GGUFQuantTensor, dtype: torch.dtype):
        self.table = KQuantLinear([t])
        self.dtype = dtype

    def nbytes(self) -> int:
        return self.table.nbytes()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> [T, K] in `dtype`."""
        t = self.table
        rows = t.blocks[0].index_select(0, ids)
        if cpu_ext.load():
            return torch.ops.laneserve.kquant_dequantize(rows, t.qtypes[0]).to(self.dtype)
        p = t.parts[0]
        part = GGUFQuantTensor(p.name, p.qtype, rows.numpy(), (ids.shape[0], p.shape[1]))
        return dequantize(part).to(self.dtype)


def random_blocks(qtype: str, rows: int, cols: int, rng, scale: float = 0.1) -> np.ndarray:
    """Random `qtype` super-blocks uint8 [rows, cols / 256 * bytes] with fp16 d (and dmin) drawn
    from [scale / 100, scale]: every bit pattern of the packed scales and quants is a valid block
    (the kernels' tests and `scripts/bench_kquant.py`; gguf-py has no K-quant quantizer)."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    d = rng.uniform(scale / 100, scale, size=(rows, cols // block_size, 2)).astype(np.float16)
    if qtype == "Q6_K":  # ql, qh, scales, then d
        raw[..., -2:] = d[..., :1].view(np.uint8)
    else:  # d, dmin, then the rest
        raw[..., :4] = d.view(np.uint8)
    return raw.reshape(rows, -1)
