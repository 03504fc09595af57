"""The K-quant GEMV and dequantization (kernels/csrc/kquant_gemv.cpp, gpu_worker/kquant.py) against
the `gguf` package's own dequantization, on random super-blocks.

gguf-py has no K-quant quantizer, so the blocks are random bytes with sane fp16 super-block scales
(every bit pattern of the packed scales and quants is a valid block). Shapes are odd on purpose:
N = 37 outputs, K = 3 super-blocks; every route the build has (fp32: AVX-512, AVX2, scalar; int8:
AVX-512 VNNI, AVX2, scalar) is forced in turn. The int8 route is checked against the float64 dot
product of the dequantized weights with the activations rounded as llama.cpp's Q8_K rounds them
(`q8k_reference`), which it computes exactly up to float32 rounding.
On an AVX2-only machine the AVX-512 VNNI route (512-bit registers, kquant_q8k_avx512.h: four
outputs at a time past one row, rows in tiles past 256 KiB of activations) is not built and
cannot run here; every process self-checks its routes on first use (`kquant.q8k_route`, tested
below).
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from laneserve.gpu_worker import kquant
from laneserve.gpu_worker.gguf_blocks import GGUFQuantTensor
from laneserve.gpu_worker.kquant import (
    KQUANT_GEMV_MAX_TOKENS,
    KQUANT_Q8K_MAX_TOKENS,
    QTYPE_IDS,
    KQuantEmbedding,
    KQuantLinear,
)
from laneserve.gpu_worker.kquant import random_blocks as kquant_blocks
from laneserve.kernels import cpu_ext

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

N, K = 37, 3 * 256


def reference(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    w = quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32))


def q8k_reference(x: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] as float64 after Q8_K rounding: per 256 values d = max|x| / 127,
    round(x * (127 / max|x|)) ties to even, times d (all in float32 as the kernel does)."""
    blocks = x.numpy().reshape(x.shape[0], -1, 256)
    amax = np.abs(blocks).max(-1, keepdims=True)
    iscale = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    q = np.clip(np.rint(blocks * iscale), -127, 127)
    d = (amax / np.float32(127)).astype(np.float64)
    return torch.from_numpy((q * d).reshape(x.shape))


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


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_int8_route_is_the_exact_dot_of_q8k_activations_on_every_route(qtype):
    rng = np.random.default_rng(10 + QTYPE_IDS[qtype])
    blocks = kquant_blocks(qtype, N, K, rng)
    w = reference(blocks, qtype).double()
    routes = list(torch.ops.laneserve.kquant_q8k_routes())
    assert 3 in routes and routes == sorted(routes)
    x = torch.from_numpy(rng.standard_normal((4, K), dtype=np.float32))  # seeded: the bound
    x *= torch.tensor([1.0, 1e-3, 50.0, 1.0])[:, None]  # below is statistical (0.034 was seen)
    x[3, 256:512] = 0  # a block of zeros: scale 0, no division by it
    x[0, 7] = 9.0  # one outlier: the rest of its block rounds coarser
    want = q8k_reference(x) @ w.T
    exact = x.double() @ w.T
    for m in (1, 4):
        for route in [0, *routes]:
            y = torch.ops.laneserve.kquant_gemv_q8k(
                x[:m].contiguous(), torch.from_numpy(blocks), QTYPE_IDS[qtype], route
            )
            assert y.dtype == torch.float32 and y.shape == (m, N)
            scale = want[:m].abs().amax(1, keepdim=True)
            assert ((y.double() - want[:m]).abs() / scale).max() < 2e-6, route
            # the activations' int8 rounding: ~1 % of the row's largest output here
            assert ((y.double() - exact[:m]).abs() / scale).max() < 3e-2, route
    nan = x[:2].clone()
    nan[1, 300] = float("nan")  # a NaN activation is not rounded away
    y = torch.ops.laneserve.kquant_gemv_q8k(nan, torch.from_numpy(blocks), QTYPE_IDS[qtype], 0)
    assert y[0].isfinite().all() and y[1].isnan().all()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_int8_route_over_row_tiles_and_a_partial_group_of_outputs(qtype):
    """K = 64 super-blocks: the AVX-512 route takes its rows in tiles of at most 16 (256 KiB of
    int8 activations / K), of equal size: 37 rows make tiles of 13, 13 and 11, and 7 outputs a
    group of four and one of three: every route against the exact dot of the Q8_K activations."""
    rng = np.random.default_rng(20 + QTYPE_IDS[qtype])
    n, k, m = 7, 64 * 256, 37
    blocks = kquant_blocks(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    x *= torch.logspace(-2, 2, m)[:, None]
    want = q8k_reference(x) @ reference(blocks, qtype).double().T
    scale = want.abs().amax(1, keepdim=True)
    for route in torch.ops.laneserve.kquant_q8k_routes():
        y = torch.ops.laneserve.kquant_gemv_q8k(
            x, torch.from_numpy(blocks), QTYPE_IDS[qtype], route
        )
        # float32 sums of 64 super-blocks' terms: up to ~2.3e-6 on every route (20 seeds)
        assert ((y.double() - want).abs() / scale).max() < 1e-5, route


@pytest.mark.parametrize("qtype", kquant.X16_QTYPES)
def test_x16_layout_gives_the_exact_dot_on_every_route(qtype):
    """`repack_x16` (16 outputs' super-blocks interleaved, kernels/csrc/kquant_q8k_x16.h) and the
    int8 GEMV on it: 48 outputs, K = 64 super-blocks (the VNNI route takes 37 rows in tiles of 13,
    13 and 11), 1, 2 and 37 rows, alone and fused beside a part in the file's layout: every route
    (the ones without x16 code run the reference) against the exact dot of the Q8_K activations;
    its dequantization equals the gguf package's of the file's blocks."""
    rng = np.random.default_rng(40 + QTYPE_IDS[qtype])
    n, k, q = 48, 64 * 256, QTYPE_IDS[qtype]
    blocks = kquant_blocks(qtype, n, k, rng)
    packed = kquant.repack_x16(torch.from_numpy(blocks), q)
    assert packed.shape[0] == n // 16
    x = torch.from_numpy(rng.standard_normal((37, k), dtype=np.float32))
    x *= torch.logspace(-2, 2, 37)[:, None]
    want = q8k_reference(x) @ reference(blocks, qtype).double().T
    scale = want.abs().amax(1, keepdim=True)
    for route in torch.ops.laneserve.kquant_q8k_routes():
        for m in (1, 2, 37):
            y = torch.ops.laneserve.kquant_gemv_q8k(x[:m].contiguous(), packed, q | 256, route)
            assert ((y.double() - want[:m]).abs() / scale[:m]).max() < 1e-5, (route, m)
        fused = torch.ops.laneserve.kquant_gemv_q8k_fused(
            x[:2].contiguous(), [torch.from_numpy(blocks[:7]), packed], [q, q | 256], route
        )
        assert fused.shape == (2, 7 + n)
        assert ((fused[:, 7:].double() - want[:2]).abs() / scale[:2]).max() < 1e-5, route
        assert ((fused[:, :7].double() - want[:2, :7]).abs() / scale[:2]).max() < 1e-5, route
    dense = torch.ops.laneserve.kquant_dequantize_x16(packed, q)
    assert torch.equal(dense, reference(blocks, qtype))  # exact, as the file's blocks give it
    for route in torch.ops.laneserve.kquant_q8k_routes():  # no rows: an empty result
        for w, t in ((packed, q | 256), (torch.from_numpy(blocks), q)):
            assert torch.ops.laneserve.kquant_gemv_q8k(x[:0], w, t, route).shape == (0, n)
    with pytest.raises(RuntimeError, match="no flag"):
        torch.ops.laneserve.kquant_dequantize_x16(packed, q | 256)
    with pytest.raises(RuntimeError, match="out must be contiguous uint8"):
        torch.ops.laneserve.kquant_repack_x16_(torch.from_numpy(blocks), q, packed[:1])
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        kquant.repack_x16(torch.from_numpy(blocks[:40]), q)
    with pytest.raises(RuntimeError, match="qtype 2 is not Q4_K"):
        kquant.repack_x16(torch.from_numpy(blocks[:16]), 2)


def test_linears_repack_their_parts_to_the_x16_layout(monkeypatch):
    """A fused linear's K-quant parts of whole 16-output groups take the x16 layout where it is
    enabled (`kquant.x16_enabled`: the AVX-512 VNNI route; forced here, so the other routes run
    its reference GEMV), in chunks of `X16_REPACK_ROWS` (16 here: several); the rest stay as the
    file ships them. Outputs agree with the file's layout up to float32 summation order, the
    dequantization is the same, and no file-layout copy of a repacked part is kept."""
    monkeypatch.setenv("LANESERVE_KQUANT_INT8", "1")
    monkeypatch.setattr(kquant, "X16_REPACK_ROWS", 16)
    rng = np.random.default_rng(6)
    shapes = [("Q4_K", 48), ("Q5_K", 16), ("Q6_K", 32), ("Q4_K", 8)]
    parts = [
        GGUFQuantTensor(f"p{i}", t, kquant_blocks(t, n, K, rng), (n, K))
        for i, (t, n) in enumerate(shapes)
    ]
    plain = KQuantLinear(parts, repack=False)
    monkeypatch.setattr(kquant, "x16_enabled", lambda: True)
    linear = KQuantLinear(parts)
    assert [bool(q & kquant.X16_FLAG) for q in linear.qtypes] == [True, True, True, False]
    assert [r is None for r in linear.rows] == [True, True, True, False]
    assert not any(q & kquant.X16_FLAG for q in plain.qtypes)
    gen = torch.Generator().manual_seed(0)
    for m in (1, 5):
        x = torch.randn(m, K, generator=gen)
        y, want = linear(x), plain(x)  # the same integer sums: float32 order only
        assert ((y - want).abs() / want.abs().amax(1, keepdim=True)).max() < 1e-5, m
    assert torch.equal(linear.dequantize(), plain.dequantize())
    monkeypatch.setenv("LANESERVE_KQUANT_INT8", "0")  # the fp32 route reads no x16 part: tiles
    x = torch.randn(3, K, generator=gen)
    y, want = linear(x), plain(x)  # float32 dots of 768 terms in two orders (~1e-6)
    assert ((y - want).abs() / want.abs().amax(1, keepdim=True)).max() < 1e-4


def test_calls_take_the_int8_gemv_up_to_their_routes_limit(monkeypatch):
    """On the AVX-512 VNNI route every call runs the int8 GEMV (prefill chunks too), elsewhere
    calls past `KQUANT_Q8K_MAX_TOKENS` dequantize tiles (float32 activations: the outputs differ
    from the int8 GEMV's)."""
    monkeypatch.setenv("LANESERVE_KQUANT_INT8", "1")
    blocks = kquant_blocks("Q4_K", N, K, np.random.default_rng(5))
    linear = KQuantLinear([GGUFQuantTensor("p", "Q4_K", blocks, (N, K))])
    for route in torch.ops.laneserve.kquant_q8k_routes():
        monkeypatch.setattr(kquant, "q8k_route", lambda route=route: route)
        limit = kquant.q8k_max_tokens("Q4_K")
        assert (limit == float("inf")) == (route == kquant.Q8K_VNNI_ROUTE), route
        rows = [1, KQUANT_Q8K_MAX_TOKENS["Q4_K"], KQUANT_Q8K_MAX_TOKENS["Q4_K"] + 1, 300]
        for m in rows:
            x = torch.randn(m, K)
            gemv = torch.ops.laneserve.kquant_gemv_q8k(x, torch.from_numpy(blocks), 12, route)
            assert torch.equal(linear(x), gemv) == (m <= limit), (route, m)


def test_routes_this_cpu_has_are_built():
    flags = open("/proc/cpuinfo").read()
    routes = list(torch.ops.laneserve.kquant_routes())
    assert (1 in routes) == (" avx512f" in flags)
    assert (2 in routes) == (" avx2" in flags and " fma" in flags)
    q8k = list(torch.ops.laneserve.kquant_q8k_routes())
    assert (1 in q8k) == (" avx512_vnni" in flags and " avx512bw" in flags)
    assert (2 in q8k) == (" avx2" in flags and " fma" in flags)


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
    with pytest.raises(RuntimeError, match="x has 255 columns"):
        torch.ops.laneserve.kquant_gemv_q8k(torch.zeros(1, 255), blocks, QTYPE_IDS["Q4_K"], 0)
    with pytest.raises(RuntimeError, match="qtype 11 is not Q4_K"):
        torch.ops.laneserve.kquant_gemv_q8k(torch.zeros(1, 256), blocks, 11, 0)
    q8k = list(torch.ops.laneserve.kquant_q8k_routes())
    missing = next(r for r in (1, 2, 3, 4) if r not in q8k)
    with pytest.raises(RuntimeError, match=f"route {missing} is not built"):
        torch.ops.laneserve.kquant_gemv_q8k(torch.zeros(1, 256), blocks, QTYPE_IDS["Q4_K"], missing)


def test_int8_self_check_keeps_the_widest_route_that_agrees(caplog):
    """On this CPU every built route agrees with the scalar one: the widest is used, no warning."""
    routes = list(torch.ops.laneserve.kquant_q8k_routes())
    with caplog.at_level("WARNING", logger=kquant.__name__):
        assert kquant.check_q8k_routes(routes) == routes[0]
        assert kquant.q8k_route() == routes[0]
    assert not caplog.records


def test_x16_self_check_keeps_the_file_layout_when_the_x16_gemv_disagrees(caplog):
    """`kquant.check_x16` compares the x16 GEMV (route 1, played by the real reference route for
    the layout) with the scalar route on the file's layout: exact agreement passes silently; an
    x16-only fault of 1e-4 of a row's largest output, or a NaN, fails with one warning each."""
    real = torch.ops.laneserve.kquant_gemv_q8k

    def faulty(error: float):
        def gemv(x, blocks, qtype, route):
            y = real(x, blocks, qtype, 3 if route == 1 else route)
            if qtype & kquant.X16_FLAG:
                y[-1, 17] += error * y[-1].abs().max()
            return y

        return gemv

    with caplog.at_level("WARNING", logger=kquant.__name__):
        assert kquant.check_x16(faulty(0.0))
        assert not caplog.records
        assert not kquant.check_x16(faulty(1e-4))
        assert not kquant.check_x16(faulty(float("nan")))
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(messages) == 2 and all("x16 layout's GEMV disagrees" in m for m in messages)
    if kquant.Q8K_VNNI_ROUTE in torch.ops.laneserve.kquant_q8k_routes():
        assert kquant.x16_self_check()  # the real x16 GEMV on this CPU


def test_int8_self_check_disables_a_route_that_disagrees(caplog):
    """A faulty widest route (here: route 1, AVX-512 VNNI, played by the real scalar kernel with
    one output off by 1e-4 of its row's largest) is skipped with one warning naming it, and the
    next route down is checked and used; an error of 1e-7 (float rounding) or a NaN decide
    as they should."""
    real = torch.ops.laneserve.kquant_gemv_q8k

    def faulty(error: float, bad: tuple[int, ...] = (1,)):
        def gemv(x, blocks, qtype, route):
            y = real(x, blocks, qtype, 3 if route == 1 else route)
            if route in bad:
                y[-1, 5] += error * y[-1].abs().max()
            return y

        return gemv

    with caplog.at_level("WARNING", logger=kquant.__name__):
        assert kquant.check_q8k_routes([1, 3], faulty(1e-7)) == 1
        assert not caplog.records
        assert kquant.check_q8k_routes([1, 3], faulty(1e-4)) == 3
        assert kquant.check_q8k_routes([1, 3], faulty(float("nan"))) == 3
        # the routes below the one played faulty: [2, 3] on AVX2 and AVX-512 CPUs alike
        built = [r for r in torch.ops.laneserve.kquant_q8k_routes() if r != 1]
        assert kquant.check_q8k_routes([1, *built], faulty(1e-4)) == built[0]
        assert kquant.check_q8k_routes([1, *built], faulty(1e-4, (1, built[0]))) == built[-1]
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(messages) == 4 + (built[0] != 3), messages  # one per faulty route per check
    assert all("the AVX-512 VNNI route (1) disagrees" in m for m in messages[:4]), messages
    if built[0] != 3:
        assert f"route ({built[0]}) disagrees" in messages[4], messages


def test_linear_runs_the_self_checked_route(monkeypatch):
    """KQuantLinear's int8 calls take `q8k_route()`'s verdict, not the kernel's widest route."""
    monkeypatch.setenv("LANESERVE_KQUANT_INT8", "1")
    blocks = kquant_blocks("Q4_K", N, K, np.random.default_rng(5))
    linear = KQuantLinear([GGUFQuantTensor("p", "Q4_K", blocks, (N, K))])
    x = torch.randn(2, K)
    ys = {}
    for route in torch.ops.laneserve.kquant_q8k_routes():
        monkeypatch.setattr(kquant, "q8k_route", lambda route=route: route)
        ys[route] = torch.ops.laneserve.kquant_gemv_q8k(x, torch.from_numpy(blocks), 12, route)
        assert torch.equal(linear(x), ys[route]), route
    if len(ys) > 1:  # the routes round differently, so the check above tells them apart
        assert not torch.equal(*list(ys.values())[-2:])


@pytest.mark.parametrize("int8", [False, True])
def test_fused_linear_of_mixed_k_types_on_gemv_and_gemm_routes(int8, monkeypatch):
    """A fusion of all three types: few rows take a GEMV (the int8 one, or with
    LANESERVE_KQUANT_INT8=0 the exact fp32 one), more than a type's limit the tile-dequantizing
    GEMM (20 rows: some parts each on the fp32 GEMV); bf16 in, bf16 out. The int8 GEMV runs on
    the widest route with limits (AVX2, else scalar): the AVX-512 one takes every call."""
    monkeypatch.setenv("LANESERVE_KQUANT_INT8", "1" if int8 else "0")
    limited = [r for r in torch.ops.laneserve.kquant_q8k_routes() if r != kquant.Q8K_VNNI_ROUTE]
    monkeypatch.setattr(kquant, "q8k_route", lambda: limited[0])
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
    limits = sorted((KQUANT_Q8K_MAX_TOKENS if int8 else KQUANT_GEMV_MAX_TOKENS).values())
    assert int8 or limits[0] < 20 <= limits[-1]
    tol = 3e-2 if int8 else 1e-4  # the activations' int8 rounding (see the test above)
    for m in (1, 20, limits[-1] + 5):
        x = torch.randn(m, K)
        want = x.double() @ w.double().T + bias.double()
        y = linear(x, bias).double()
        torch.testing.assert_close(y, want, rtol=tol, atol=tol * want.abs().max().item())
        if int8 and m <= limits[0]:  # the int8 GEMV: the exact dot of Q8_K activations
            q8 = q8k_reference(x) @ w.double().T + bias.double()
            torch.testing.assert_close(y, q8, rtol=1e-5, atol=1e-5 * q8.abs().max().item())
        y16 = linear(x.bfloat16())
        assert y16.dtype == torch.bfloat16
        want16 = (x.bfloat16().double() @ w.double().T).float()
        tol16 = 3e-2 if int8 else 1e-2
        torch.testing.assert_close(y16.float(), want16, rtol=tol16, atol=tol16 * want16.abs().max())


def test_embedding_lookup_dequantizes_its_rows():
    rng = np.random.default_rng(3)
    table = GGUFQuantTensor("e", "Q6_K", kquant_blocks("Q6_K", N, K, rng), (N, K))
    emb = KQuantEmbedding(table, torch.float32)
    ids = torch.tensor([5, 0, 36, 5])
    torch.testing.assert_close(emb(ids), reference(table.blocks, "Q6_K")[ids], rtol=1e-6, atol=0)


def test_fused_int8_gemv_splits_parts_by_bytes_and_matches_each_part():
    """`kquant_gemv_q8k_fused` over parts of all three types and one in the x16 layout (1 MB: split
    across the threads by bytes, a boundary inside a part) gives exactly the single-part calls'
    outputs, side by side, on every route; bf16 rows give the float32 result of the same rows
    rounded to bf16."""
    rng = np.random.default_rng(11)
    types, rows = ["Q4_K", "Q6_K", "Q5_K", "Q6_K"], [2048, 1537, 300, 1024]
    blocks = [
        torch.from_numpy(kquant_blocks(t, n, 256, rng)) for t, n in zip(types, rows, strict=True)
    ]
    qtypes = [QTYPE_IDS[t] for t in types]
    blocks[3] = kquant.repack_x16(blocks[3], qtypes[3])  # a part in the x16 layout (64 units)
    qtypes[3] |= kquant.X16_FLAG
    assert sum(b.numel() for b in blocks) > 1 << 19  # more than one task's bytes
    x = torch.randn(3, 256)
    for route in [0, *torch.ops.laneserve.kquant_q8k_routes()]:
        y = torch.ops.laneserve.kquant_gemv_q8k_fused(x, blocks, qtypes, route)
        parts = [
            torch.ops.laneserve.kquant_gemv_q8k(x, b, t, route)
            for b, t in zip(blocks, qtypes, strict=True)
        ]
        assert torch.equal(y, torch.cat(parts, dim=1)), route
        # bf16 rows: the result of the widened rows, rounded to bf16 by each task as torch does
        xb = x.bfloat16()
        yb = torch.ops.laneserve.kquant_gemv_q8k_fused(xb, blocks, qtypes, route)
        want = torch.ops.laneserve.kquant_gemv_q8k_fused(xb.float(), blocks, qtypes, route)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, want.bfloat16()), route
    for dtype in (torch.float32, torch.bfloat16):  # K = 0: empty sums, zeros
        none = torch.empty(3, 0, dtype=torch.uint8)
        y = torch.ops.laneserve.kquant_gemv_q8k(torch.ones(2, 0, dtype=dtype), none, qtypes[0], 0)
        assert y.dtype == dtype and torch.equal(y, torch.zeros(2, 3, dtype=dtype))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.laneserve.kquant_gemv_q8k_fused(x.half(), blocks, qtypes, 0)
    with pytest.raises(RuntimeError, match="one qtype per blocks tensor"):
        torch.ops.laneserve.kquant_gemv_q8k_fused(x, blocks, qtypes[:2], 0)
