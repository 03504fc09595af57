"""K-quant GGUF weights (Q4_K, Q5_K, Q6_K) executed on their own 256-weight super-blocks.

A `KQuantLinear` holds the super-blocks of each (fused) part as the file ships them (a view of
the mapped file where the loader did not have to permute the rows), so memory is about the file
size; on the AVX-512 VNNI route its parts are repacked at load to the x16 layout (16 outputs'
super-blocks interleaved, kernels/csrc/kquant_q8k_x16.h: about half the instructions per
weight, the one-row GEMV then reads at the memory's rate), and the file's pages they were read
from are dropped: memory stays about the file size (Q4_K +2.8 %, Q5_K +2.3 %, Q6_K +1 % in the
x16 layout). Calls of at most `q8k_max_tokens(qtype)` rows (all of them on the AVX-512 VNNI route;
`KQUANT_Q8K_MAX_TOKENS[qtype]` elsewhere: decode, speculative verification, small batches) run
the int8 GEMV (``torch.ops.laneserve.kquant_gemv_q8k``, or for a fused
linear whose parts all take it ``kquant_gemv_q8k_fused``: one call over all parts,
kernels/csrc/kquant_q8k.cpp: the activations quantized once per call to llama.cpp's Q8_K, int8
per 256 with a float scale, and integer dot products with the weights' own quants on the
AVX-512 VNNI, AVX2 or scalar route the build has; ~0.4 % of a block's largest activation of
rounding per element, as llama.cpp). The route is the widest that passes `q8k_route`'s first-use
self-check against the scalar route (a SIMD route that disagrees is disabled for the process with
a warning). ``LANESERVE_KQUANT_INT8=0`` keeps the activations exact:
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

import functools
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from laneserve.contracts import env
from laneserve.gpu_worker.gguf_blocks import (
    K_QUANT_TYPES,
    GGUFQuantTensor,
    dequantize,
    drop_file_pages,
)
from laneserve.gpu_worker.kernel_routes import (  # noqa: F401 (re-exported)
    KQUANT_GEMV_MAX_TOKENS,
    KQUANT_Q8K_MAX_TOKENS,
)
from laneserve.kernels import cpu_ext

logger = logging.getLogger(__name__)

QTYPE_IDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml's type numbers, the kernel's `qtype`
X16_FLAG = 256  # `qtype | X16_FLAG`: the blocks are in the x16 layout (kquant_q8k_x16.h)
X16_QTYPES = ("Q4_K", "Q5_K", "Q6_K")
X16_ROWS = 16  # outputs per x16 unit
QK_K = 256  # weights per super-block
KQUANT_TILE_ROWS = 512  # outputs dequantized at a time on the GEMM route (512 x 2048 x 4 = 4 MiB)
# The int8 GEMV's routes (kernels/csrc/kquant_q8k.cpp), widest first; 3 is the reference.
Q8K_ROUTE_NAMES = {1: "AVX-512 VNNI", 2: "AVX2", 3: "scalar"}
Q8K_SCALAR_ROUTE = 3
Q8K_VNNI_ROUTE = 1
# Routes compute the same integer sums and differ only in float32 summation order: ~1e-7 of the
# terms' magnitude (at most ~2e-6 of a row's largest output over random blocks); a wrong index or
# scale is off by O(1).
Q8K_SELF_CHECK_RTOL = 1e-5


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


class PartSpec(NamedTuple):
    """What a `KQuantLinear` keeps of a part besides its blocks."""

    name: str
    qtype: str
    shape: tuple[int, int]


class KQuantLinear:
    """`y = x @ W.T` with W = cat of K-quant parts [N_i, K] along N, each kept in its blocks.

    `blocks` / `qtypes` are what the GEMV reads: each part's blocks as the file ships them, or
    on the AVX-512 VNNI route (`x16_enabled`) a part of whole 16-output groups repacked at load
    to the row-interleaved x16 layout (`repack_x16`, qtype | `X16_FLAG`); the file's pages it was
    read from are dropped and the loader's copy (Llama's q / k rows, un-permuted) is not kept.
    `rows[i]` is the file's layout where kept (None for an x16 part: it dequantizes from x16)."""

    def __init__(self, parts: list[GGUFQuantTensor], repack: bool = True):
        assert parts and all(is_kquant(p) for p in parts), [p.qtype for p in parts]
        ks = {p.shape[1] for p in parts}
        assert len(ks) == 1, ks
        self.parts = [PartSpec(p.name, p.qtype, p.shape) for p in parts]
        self.rows: list[torch.Tensor | None] = [_blocks_tensor(p) for p in parts]
        self.blocks = list(self.rows)
        self.qtypes = [QTYPE_IDS[p.qtype] for p in parts]
        self.shape = (sum(p.shape[0] for p in parts), ks.pop())
        if repack and x16_enabled():
            for i, p in enumerate(parts):
                if p.qtype in X16_QTYPES and p.shape[0] % X16_ROWS == 0:
                    self.blocks[i] = repack_x16(self.rows[i], self.qtypes[i], p.blocks)
                    self.qtypes[i] |= X16_FLAG
                    self.rows[i] = None

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] (exact: the GGUF's values)."""
        return torch.cat([self._tile(i, 0, p.shape[0]) for i, p in enumerate(self.parts)])

    def _tile(self, i: int, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 of part i as float32 (an x16 part: r0, r1 multiples of 16)."""
        p = self.parts[i]
        if self.rows[i] is None:
            assert r0 % X16_ROWS == 0 and r1 % X16_ROWS == 0, (r0, r1)
            packed = self.blocks[i][r0 // X16_ROWS : r1 // X16_ROWS]
            return torch.ops.laneserve.kquant_dequantize_x16(packed, QTYPE_IDS[p.qtype])
        blocks = self.rows[i][r0:r1]
        if cpu_ext.load():
            return torch.ops.laneserve.kquant_dequantize(blocks, QTYPE_IDS[p.qtype])
        return dequantize(GGUFQuantTensor(p.name, p.qtype, blocks.numpy(), (r1 - r0, p.shape[1])))

    def _gemm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return tiled_linear(x, self.parts[i].shape[0], lambda r0, r1: self._tile(i, r0, r1))

    def _part(self, xf: torch.Tensor, i: int) -> torch.Tensor:
        """Part i of `xf @ W.T` on the route for its row count (module docstring)."""
        rows, qtype = xf.shape[0], self.parts[i].qtype
        if cpu_ext.load():
            if env.get("LANESERVE_KQUANT_INT8") and rows <= q8k_max_tokens(qtype):
                route = q8k_route()
                return torch.ops.laneserve.kquant_gemv_q8k(
                    xf, self.blocks[i], self.qtypes[i], route
                )
            if rows <= KQUANT_GEMV_MAX_TOKENS[qtype] and self.rows[i] is not None:
                return torch.ops.laneserve.kquant_gemv(xf, self.rows[i], QTYPE_IDS[qtype], 0)
        return self._gemm(xf, i)

    def _int8_fused(self, x: torch.Tensor) -> bool:
        """Whether every part of a call of `x`'s rows runs the int8 GEMV: then one kernel call
        quantizes the activations once and splits all parts' bytes across the threads."""
        rows = x.shape[0]
        if not (cpu_ext.load() and env.get("LANESERVE_KQUANT_INT8")):
            return False
        return all(rows <= q8k_max_tokens(p.qtype) for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self._int8_fused(x):
            # bf16 rows in and out of the one call: the kernel widens them exactly and rounds
            # its float32 sums as `.to` would (two ATen conversions a call less: ~0.9 ms of a
            # Llama-3.2-1B Q4_K_M decode step's 31-35 on a 2-core Zen 4); a bias adds in float32
            direct = bias is None and x.dtype in (torch.bfloat16, torch.float32)
            xin = x.contiguous() if direct else x.float().contiguous()
            y = torch.ops.laneserve.kquant_gemv_q8k_fused(
                xin, self.blocks, self.qtypes, q8k_route()
            )
            if direct:
                return y
        else:
            xf = x.float().contiguous()
            ys = [self._part(xf, i) for i in range(len(self.parts))]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def tiled_linear(
    x: torch.Tensor,
    n: int,
    tile: Callable[[int, int], torch.Tensor],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for a weight W [n, K] that is never whole in memory: `tile(r0, r1)`
    gives its rows r0..r1 as float32, `KQUANT_TILE_ROWS` at a time, each multiplied by a dense
    GEMM in x's dtype and freed (the GEMM route of K-quant linears, and of Q8_0 ones whose
    model is too big for dense copies: `quantization.QuantLinear`)."""
    tiles = []
    for r0 in range(0, n, KQUANT_TILE_ROWS):
        r1 = min(n, r0 + KQUANT_TILE_ROWS)
        w = tile(r0, r1).to(x.dtype)
        tiles.append(F.linear(x, w, None if bias is None else bias[r0:r1]))
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)


def x16_enabled() -> bool:
    """Whether K-quant linears repack their parts to the x16 layout: the C++ kernels loaded, the
    int8 GEMV on (``LANESERVE_KQUANT_INT8``) and on the AVX-512 VNNI route, the only one with an
    x16 GEMV (kernels/csrc/kquant_q8k_x16.h: 2x fewer instructions per weight than the file's
    layout; one-row calls were bound by them), and that GEMV passing `x16_self_check`."""
    if not (cpu_ext.load() and env.get("LANESERVE_KQUANT_INT8")):
        return False
    return q8k_route() == Q8K_VNNI_ROUTE and x16_self_check()


@functools.cache
def x16_self_check() -> bool:
    """`check_x16` once per process, on first use (the C++ kernels must be loaded)."""
    return check_x16()


X16_REPACK_ROWS = 4096  # rows repacked at a time: the file pages they touched are then dropped


def repack_x16(blocks: torch.Tensor, qtype: int, mapped: np.ndarray | None = None) -> torch.Tensor:
    """K-quant blocks uint8 [N, K / 256 * bytes] (N a multiple of 16) in the x16 layout
    [N / 16, K / 256 * unit bytes]; the GEMV takes it as `qtype | X16_FLAG`. `mapped`: the
    file's view that `blocks` reads, whose pages are dropped as they are repacked (the load's
    peak RSS then holds the copy, not the copy and the file)."""
    n = blocks.shape[0]
    if n <= X16_REPACK_ROWS:
        out = torch.ops.laneserve.kquant_repack_x16(blocks, qtype)
        if mapped is not None:
            drop_file_pages(mapped)
        return out
    row_bytes = torch.ops.laneserve.kquant_repack_x16(blocks[:X16_ROWS], qtype).shape[1]
    out = torch.empty((n // X16_ROWS, row_bytes), dtype=torch.uint8)
    for r0 in range(0, n, X16_REPACK_ROWS):
        r1 = min(n, r0 + X16_REPACK_ROWS)
        chunk = out[r0 // X16_ROWS : r1 // X16_ROWS]
        torch.ops.laneserve.kquant_repack_x16_(blocks[r0:r1], qtype, chunk)
        if mapped is not None:
            drop_file_pages(mapped[r0:r1])
    return out


Q8KGemv = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def q8k_max_tokens(qtype: str) -> float:
    """The most rows a call of `qtype` runs on the int8 GEMV: every call on the AVX-512 VNNI
    route, `KQUANT_Q8K_MAX_TOKENS` on the others (kernel_routes.py says why)."""
    return math.inf if q8k_route() == Q8K_VNNI_ROUTE else KQUANT_Q8K_MAX_TOKENS[qtype]


@functools.cache
def q8k_route() -> int:
    """The int8 GEMV route this process uses: the widest built route (``kquant_q8k_routes()``)
    that agrees with the scalar one in `check_q8k_routes`, run once, on first use (the C++
    kernels must be loaded). Guards the routes this project's CI machines cannot execute (the
    AVX-512 VNNI one is the default on AVX-512 CPUs) against silently wrong logits."""
    start = time.perf_counter()
    route = check_q8k_routes(list(torch.ops.laneserve.kquant_q8k_routes()))
    ms = (time.perf_counter() - start) * 1e3
    logger.debug("kquant int8 GEMV: route %d (%s), self-check %.1f ms", route,
                 Q8K_ROUTE_NAMES.get(route, "?"), ms)  # fmt: skip
    return route


def check_q8k_routes(routes: list[int], gemv: Q8KGemv | None = None) -> int:
    """The first of `routes` (widest first) whose int8 GEMV agrees with the scalar route's on a
    fixed random set: 9 outputs x 2 super-blocks of each of Q4_K, Q5_K, Q6_K, times 2 activation
    rows and times the first row alone (a route may run one row, and a last group of outputs,
    by other code: the AVX-512 one does).
    Agreement: |y - y_scalar| <= `Q8K_SELF_CHECK_RTOL` x the row's largest |y_scalar| (NaN
    disagrees). Each route that disagrees is logged as one WARNING and skipped; the scalar route
    is taken as correct. `gemv` (x, blocks, qtype, route) -> y defaults to the kernel
    ``torch.ops.laneserve.kquant_gemv_q8k``; tests pass a faulty one. 0.5 ms on a 2-core AVX2
    EPYC (7 ms as a process's first use of the op)."""
    gemv = gemv or torch.ops.laneserve.kquant_gemv_q8k
    rng = np.random.default_rng(0)  # fixed: a route's verdict does not vary between processes
    weights = [
        (QTYPE_IDS[t], torch.from_numpy(random_blocks(t, 9, 2 * QK_K, rng))) for t in QTYPE_IDS
    ]
    x = torch.from_numpy(rng.standard_normal((2, 2 * QK_K), dtype=np.float32))
    x[1] *= torch.from_numpy(rng.uniform(0.01, 10.0, size=2 * QK_K).astype(np.float32))
    cases = [(xs, qtype, blocks) for xs in (x, x[:1]) for qtype, blocks in weights]
    want = [gemv(xs, blocks, qtype, Q8K_SCALAR_ROUTE) for xs, qtype, blocks in cases]
    for route in routes:
        if route == Q8K_SCALAR_ROUTE:
            return route
        ys = [gemv(xs, blocks, qtype, route) for xs, qtype, blocks in cases]
        worst = max(_disagreement(y, w) for y, w in zip(ys, want, strict=True))
        if worst <= Q8K_SELF_CHECK_RTOL:
            return route
        logger.warning(
            "kquant int8 GEMV: the %s route (%d) disagrees with the scalar route on this CPU "
            "(%.3g of a row's largest output); disabled for this process",
            Q8K_ROUTE_NAMES.get(route, "?"), route, worst,
        )  # fmt: skip
    return Q8K_SCALAR_ROUTE


def check_x16(gemv: Q8KGemv | None = None) -> bool:
    """Whether the AVX-512 VNNI route's x16 GEMV agrees with the scalar route on the file's
    layout (`check_q8k_routes`' agreement) on a fixed random set: 32 outputs (two units) x 2
    super-blocks of each x16 type, 2 activation rows and the first alone. A disagreement is
    logged as a WARNING and the linears keep the file's layout (the route itself stays)."""
    gemv = gemv or torch.ops.laneserve.kquant_gemv_q8k
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((2, 2 * QK_K), dtype=np.float32))
    x[1] *= torch.from_numpy(rng.uniform(0.01, 10.0, size=2 * QK_K).astype(np.float32))
    worst = 0.0
    for t in X16_QTYPES:
        qtype, blocks = (
            QTYPE_IDS[t],
            torch.from_numpy(random_blocks(t, 2 * X16_ROWS, 2 * QK_K, rng)),
        )
        packed = repack_x16(blocks, qtype)
        for xs in (x, x[:1]):
            y = gemv(xs, packed, qtype | X16_FLAG, Q8K_VNNI_ROUTE)
            worst = max(worst, _disagreement(y, gemv(xs, blocks, qtype, Q8K_SCALAR_ROUTE)))
    if worst <= Q8K_SELF_CHECK_RTOL:
        return True
    logger.warning(
        "kquant int8 GEMV: the x16 layout's GEMV disagrees with the scalar route on this CPU "
        "(%.3g of a row's largest output); K-quant weights keep the file's layout", worst
    )  # fmt: skip
    return False


def _disagreement(y: torch.Tensor, want: torch.Tensor) -> float:
    """max |y - want| / the row's largest |want| over rows of [M, N]; inf where NaN or a shape
    differs."""
    if y.shape != want.shape:
        return float("inf")
    err = ((y.double() - want.double()).abs() / want.double().abs().amax(1, keepdim=True)).max()
    return float(err) if err.isfinite() else float("inf")


class KQuantEmbedding:
    """An embedding table kept in K-quant super-blocks; a lookup dequantizes its rows (exact)."""

    def __init__(self, t: GGUFQuantTensor, dtype: torch.dtype):
        self.table = KQuantLinear([t], repack=False)
        self.dtype = dtype

    def nbytes(self) -> int:
        return self.table.nbytes()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> [T, K] in `dtype`."""
        t = self.table
        rows = t.rows[0].index_select(0, ids)
        if cpu_ext.load():
            qtype = QTYPE_IDS[t.parts[0].qtype]
            return torch.ops.laneserve.kquant_dequantize(rows, qtype).to(self.dtype)
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
