"""The dense bf16 GEMV (kernels/csrc/bf16_gemv.cpp) against float32 math on every route this
build has, and its route from `quantization.linear`.

Shapes are odd on purpose: K not a multiple of 16 or 32 (the masked and scalar tails), N not a
multiple of the 4-row weight tile, M across the 4-row activation tile (1-5, 9).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from laneserve.gpu_worker import quantization as quant
from laneserve.kernels import cpu_ext

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

SHAPES = [(88, 160), (5, 37), (130, 1024), (1, 1)]  # (N, K)
ROWS = [1, 2, 3, 4, 5, 9]


@pytest.fixture(autouse=True)
def built():
    assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


def routes() -> list[int]:
    return list(torch.ops.laneserve.bf16_gemv_routes())


def cases(dtype: torch.dtype):
    """(route, x, w) for every route that takes x's dtype, every shape and row count."""
    gen = torch.Generator().manual_seed(3)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(dtype)
            for route in routes():
                if route == 3 and dtype != torch.bfloat16:
                    continue
                yield route, x, w


def test_routes_include_the_scalar_one_and_those_of_the_cpu():
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    have = routes()
    assert have[0] == 0
    if {"avx2", "fma"} <= flags:
        assert 1 in have
    if "avx512f" in flags:
        assert 2 in have
    if {"avx512_bf16", "avx512bw"} <= flags:
        assert 3 in have


def test_float32_rows_match_float32_math_on_every_route():
    for route, x, w in cases(torch.float32):
        y = torch.ops.laneserve.bf16_gemv(x, w, route)
        ref = (x.double() @ w.double().T).float()
        bound = 2e-6 * (x.abs().double() @ w.abs().double().T).float() + 1e-30
        assert y.dtype == torch.float32 and y.shape == ref.shape
        assert ((y - ref).abs() <= bound).all(), (route, tuple(x.shape), tuple(w.shape))


def test_bf16_rows_match_float32_math_rounded_once_on_every_route():
    for route, x, w in cases(torch.bfloat16):
        y = torch.ops.laneserve.bf16_gemv(x, w, route)
        ref = x.float() @ w.float().T  # the float32 products are exact, only the sums round
        # one bf16 rounding (half an ulp: 2^-9 relative) plus float32 summation
        bound = ref.abs() * 2.0**-8 + 2e-6 * (x.float().abs() @ w.float().abs().T)
        assert y.dtype == torch.bfloat16
        assert ((y.float() - ref).abs() <= bound).all(), (route, tuple(x.shape), tuple(w.shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch_or_the_thread_split(dtype):
    threads = torch.get_num_threads()
    try:
        for route, x, w in cases(dtype):
            whole = torch.ops.laneserve.bf16_gemv(x, w, route)
            single = torch.cat([torch.ops.laneserve.bf16_gemv(r[None], w, route) for r in x])
            torch.set_num_threads(1)
            one_thread = torch.ops.laneserve.bf16_gemv(x, w, route)
            torch.set_num_threads(threads)
            assert torch.equal(whole, single) and torch.equal(whole, one_thread), route
    finally:
        torch.set_num_threads(threads)


def test_best_route_is_the_default():
    x, w = torch.randn(3, 160).bfloat16(), torch.randn(88, 160).bfloat16()
    assert torch.equal(
        torch.ops.laneserve.bf16_gemv(x, w), torch.ops.laneserve.bf16_gemv(x, w, routes()[-1])
    )
    xf = x.float()
    best_fp32 = [r for r in routes() if r != 3][-1]
    assert torch.equal(
        torch.ops.laneserve.bf16_gemv(xf, w), torch.ops.laneserve.bf16_gemv(xf, w, best_fp32)
    )


@pytest.mark.parametrize(
    "x, w, route, message",
    [
        (torch.randn(1, 8), torch.randn(4, 8), -1, "bfloat16 CPU tensor"),
        (torch.randn(1, 8), torch.randn(4, 8).bfloat16().T.contiguous().T, -1, "contiguous"),
        (torch.randn(1, 9), torch.randn(4, 8).bfloat16(), -1, r"\[M, 8\]"),
        (torch.randn(1, 8).half(), torch.randn(4, 8).bfloat16(), -1, "bfloat16 or float32"),
        (torch.randn(1, 8), torch.randn(4, 8).bfloat16(), 7, "not in this build"),
    ],
)
def test_bad_arguments_are_refused(x, w, route, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.laneserve.bf16_gemv(x, w, route)


def test_float32_x_is_refused_by_the_bf16_dot_route():
    if 3 not in routes():
        pytest.skip("no AVX512-BF16 route in this build")
    with pytest.raises(RuntimeError, match="bfloat16 x only"):
        torch.ops.laneserve.bf16_gemv(torch.randn(1, 32), torch.randn(4, 32).bfloat16(), 3)


def test_linear_routes_decode_sized_bf16_calls_to_the_gemv(monkeypatch):
    monkeypatch.setattr(quant, "BF16_DENSE_GEMV_MAX_TOKENS", 2)
    w = torch.randn(88, 160).bfloat16()
    for m in (1, 2):
        x = torch.randn(m, 160).bfloat16()
        assert quant.takes_bf16_gemv(x, w)
        assert torch.equal(quant.linear(x, w), torch.ops.laneserve.bf16_gemv(x, w))
    x = torch.randn(3, 160).bfloat16()
    assert not quant.takes_bf16_gemv(x, w)
    assert torch.equal(quant.linear(x, w), F.linear(x, w))
    # float32 models (the parity tests), a bias, a strided weight: F.linear as before
    xf, wf = torch.randn(1, 160), torch.randn(88, 160)
    assert not quant.takes_bf16_gemv(xf, wf)
    assert torch.equal(quant.linear(xf, wf), F.linear(xf, wf))
    x1, bias = torch.randn(1, 160).bfloat16(), torch.randn(88).bfloat16()
    assert torch.equal(quant.linear(x1, w, bias), F.linear(x1, w, bias))
    assert not quant.takes_bf16_gemv(x1, w.T.contiguous().T)
    monkeypatch.setattr(cpu_ext, "_state", {"ok": False})
    assert not quant.takes_bf16_gemv(x1, w)
