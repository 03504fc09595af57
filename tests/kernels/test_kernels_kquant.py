"""The K-quant GEMV and dequantization (kernels/csrc/kquant_gemv.cpp, gpu_worker/kquant.py) against
the `gguf` package's own dequantization, on random super-blocks.

gguf-py has no K-quant quantizer, so the blocks are random bytes with sane fp16 super-block scales
(every bit pattern of the packed scales and quants is a valid block). Shapes are odd on purpose:
N = 37 outputs, K = 3 super-blocks; every route the build has (AVX-512, AVX2, scalar) is forced in
turn.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor
from laneserve.gpu_worker.kquant import (
    KQUANT_GEMV_MAX_TOKENS,
    QTYPE_IDS,
    KQuantEmbedding,
    KQuantLinear,
)
from laneserve.kernels import cpu_ext

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

N, K = 37, 3 * 256


def kquant_blocks(qtype: str, rows: int, cols: int, rng, scale: float = 0.1) -> np.ndarray:
    """Random `qtype` super-blocks uint8 [rows, cols / 256 * bytes] with fp16 d (and dmin) drawn
    from [scale / 100, scale]."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    d = rng.uniform(scale / 100, scale, size=(rows, cols // block_size, 2)).astype(np.float16)
    if qtype == "Q6_K":  # ql, qh, scales, then d
        raw[..., -2:] = d[..., :1].view(np.uint8)
    else:  # d, dmin, then the rest
        raw[..., :4] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def reference(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    w = quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kernel_matches_gguf_dequantization_on_every_route(qtype):
    rng = np.random.default_rng(QTYPE_IDS[qtype])
    blocks = kquant_blocks(qtype, N, K, rng)
    w = reference(blocks, qtype)
    assert w.shape == (N, K) and w.abs().max() > 0
    ours = torch.ops.laneserve.kquant_dequantize(torch.from_numpy(blocks), QTYPE_IDS[qtype])
    torch.testing.assert_close(ours, w, rtol=1e-6, atol=0)
    routes = list(torch.ops.laneserve.kquant_routes())
    assert 3 in routes and routes == sorted(routes)  # scalar always; widest first
    for m in (1, 3, 7):
        x = torch.randn(m, K)
        want = (x.double() @ w.double().T).float()
        for route in [0, *routes]:
            y = torch.ops.laneserve.kquant_gemv(
                x, torch.from_numpy(blocks), QTYPE_IDS[qtype], route
            )
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_routes_this_cpu_has_are_built():
    flags = open("/proc/cpuinfo").read()
    routes = list(torch.ops.laneserve.kquant_routes())
    assert (1 in routes) == (" avx512f" in flags)
    assert (2 in routes) == (" avx2" in flags and " fma" in flags)


def test_bad_blocks_are_typed_errors():
    blocks = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="qtype 11 is not Q4_K"):
        torch.ops.laneserve.kquant_dequantize(blocks, 11)
    with pytest.raises(RuntimeError, match="whole number of 176-byte"):
        torch.ops.laneserve.kquant_dequantize(blocks, QTYPE_IDS["Q5_K"])
    with pytest.raises(RuntimeError, match="x has 255 columns"):
        torch.ops.laneserve.kquant_gemv(torch.zeros(1, 255), blocks, QTYPE_IDS["Q4_K"], 0)
    routes = list(torch.ops.laneserve.kquant_routes())
    missing = next(r for r in (1, 2, 3, 4) if r not in routes)
    with pytest.raises(RuntimeError, match=f"route {missing} is not built"):
        torch.ops.laneserve.kquant_gemv(torch.zeros(1, 256), blocks, QTYPE_IDS["Q4_K"], missing)


def test_fused_linear_of_mixed_k_types_on_gemv_and_gemm_routes():
    """A fusion of all three types: few rows take the GEMV, more than a type's
    `KQUANT_GEMV_MAX_TOKENS` the tile-dequantizing GEMM (20 rows: some parts each); bf16 in, bf16
    out."""
    rng = np.random.default_rng(7)
    types, rows = ["Q4_K", "Q5_K", "Q6_K"], [37, 19, 23]
    parts = [
        GGUFQuantTensor(f"p{i}", t, kquant_blocks(t, n, K, rng), (n, K))
        for i, (t, n) in enumerate(zip(types, rows, strict=True))
    ]
    linear = KQuantLinear(parts)
    w = torch.cat([reference(p.blocks, p.qtype) for p in parts])
    assert linear.shape == (sum(rows), K)
    assert linear.nbytes() == sum(p.blocks.nbytes for p in parts)
    torch.testing.assert_close(linear.dequantize(), w, rtol=1e-6, atol=0)
    bias = torch.randn(sum(rows))
    limits = sorted(KQUANT_GEMV_MAX_TOKENS.values())
    assert limits[0] < 20 <= limits[-1]
    for m in (1, 20, limits[-1] + 5):
        x = torch.randn(m, K)
        want = x.double() @ w.double().T + bias.double()
        torch.testing.assert_close(
            linear(x, bias).double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item()
        )
        y16 = linear(x.bfloat16())
        assert y16.dtype == torch.bfloat16
        want16 = (x.bfloat16().double() @ w.double().T).float()
        torch.testing.assert_close(y16.float(), want16, rtol=1e-2, atol=1e-2 * want16.abs().max())


def test_embedding_lookup_dequantizes_its_rows():
    rng = np.random.default_rng(3)
    table = GGUFQuantTensor("e", "Q6_K", kquant_blocks("Q6_K", N, K, rng), (N, K))
    emb = KQuantEmbedding(table, torch.float32)
    ids = torch.tensor([5, 0, 36, 5])
    torch.testing.assert_close(emb(ids), reference(table.blocks, "Q6_K")[ids], rtol=1e-6, atol=0)
