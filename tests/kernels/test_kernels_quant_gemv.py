"""The C++ quantized GEMVs (kernels/csrc/quant_gemv.cpp) against dequantize-then-matmul: exact
weights, activations rounded to 16-bit integers per 32-element group.

Weights are real GGUF blocks (gguf-py quantizes, the loader reads them back with
`keep_quantized=True`), on odd shapes: K = 160 (5 groups, not a multiple of 128), N = 88 / 72
(not multiples of 16 or 64), M across the row tile of 4 (1, 3, 4, 5, 17).
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from laneserve.gpu_worker import gemv_blocks, kquant
from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.gemv_blocks import GemvBlocks
from laneserve.gpu_worker.gguf_blocks import (
    GGUFQuantTensor,
    Int4Groups,
    dequantize,
    int4_from_float,
    int4_from_gguf,
    int8_from_float,
)
from laneserve.gpu_worker.gguf_loader import load_gguf_weights
from laneserve.gpu_worker.hardware import cpu_has_fast_bf16
from laneserve.gpu_worker.quantization import QuantLinear
from laneserve.kernels import cpu_ext
from tests.kernels.test_kernels_quant import CONFIG, K, write_gguf

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]  # fused: N = 40 + 24 + 24


@pytest.fixture(autouse=True)
def built():
    assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


@pytest.fixture(params=["Q4_0", "Q4_1", "Q8_0"])
def qkv(request, tmp_path):
    """(qtype, the fused qkv parts as GGUF blocks, the same weights dequantized by gguf-py)."""
    path = write_gguf(tmp_path / f"{request.param}.gguf", request.param, np.random.default_rng(7))
    kept = load_gguf_weights(gguf.GGUFReader(str(path)), CONFIG, path, keep_quantized=True)
    dense = load_gguf_weights(gguf.GGUFReader(str(path)), CONFIG, path)
    return request.param, [kept[n] for n in QKV], torch.cat([dense[n] for n in QKV])


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMVs read it (float64): per row and 32-element group, a * round(x / a) with
    a = max|x_g| / 32767 (round half to even), the scale and the quotient in float32 as the
    kernel computes them."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    e = torch.round(g * inv)
    assert e.abs().max() <= 32767
    return (e.double() * (amax / torch.tensor(32767.0)).double()).view(x.shape)


def blocks_weight(blocks: GemvBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, |scale| * q + |offset|) in float64 from the blocks' own arrays: the weight the kernel
    multiplies, and the size of the terms it adds (the offset term does not cancel in it)."""
    assert blocks.kind == "q8_0" or blocks.block_groups == 1, "read them before a call reorders"
    n = blocks.qs.shape[0]
    if blocks.kind == "q8_0":
        q = blocks.qs.double().view(n, -1, 32)
        zero = torch.zeros_like(blocks.scale.double())
    else:
        b = blocks.qs.to(torch.int32).view(n, -1, 16)
        q = torch.cat([b & 15, b >> 4], dim=2).double()
        zero = blocks.offset.double()
    scale = blocks.scale.double()[..., None]
    w = q * scale + zero[..., None]
    return w.view(n, -1), (q.abs() * scale.abs() + zero.abs()[..., None]).view(n, -1)


def gguf_blocks(qtype: str, parts: list) -> GemvBlocks:
    """The GEMV blocks of the fused qkv parts, straight from their GGUF blocks."""
    if qtype == "Q8_0":
        return GemvBlocks.from_q8_0(parts)
    return GemvBlocks.from_int4(Int4Groups.cat([int4_from_gguf(p) for p in parts]))


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17])
def test_gemv_matches_dequantized_matmul(qkv, m):
    """The GEMV reads the GGUF's own values (fp16 d and m, no bf16 rounding) and rounds each
    activation row to 16-bit integers per 32-element group: it equals W . x' (x' the rounded
    row, in float64 here) to float32 rounding of its per-group sums (the integer dots are
    exact), and that is tight enough to tell x' from x once a group holds an outlier. W . x'
    stays within the rounding's bound of W . x (each element moves by at most ~max|x_g| /
    65534): ~3e-5 relative here, far inside the bf16 tolerance torch's kernels need. A group of
    zeros (no scale) contributes nothing."""
    qtype, parts, w = qkv
    blocks = gguf_blocks(qtype, parts)
    wd, terms = blocks_weight(blocks)
    torch.testing.assert_close(wd, w.double(), atol=1e-6, rtol=0)  # gguf-py's dequantization
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    x[0, 32:64] = 0.0
    x[-1, 70] = 50.0  # an outlier: its group's step is 50 / 32767
    out = blocks(x).double()
    assert out.shape == (m, 88)
    rounded = rounded_activations(x)
    ref = rounded @ wd.T
    tol = (K // 32 + 16) * 2**-24 * (rounded.abs() @ terms.T)
    assert ((out - ref).abs() <= tol).all(), ((out - ref).abs() / tol).max()
    exact = x.double() @ wd.T
    assert ((exact - ref).abs() > tol).any()  # the rounding is visible at this tolerance
    step = (x.view(m, -1, 32).abs().amax(-1) / 65534).repeat_interleave(32, dim=1).double()
    assert ((out - exact).abs() <= 1.01 * step @ wd.abs().T + tol).all()
    if m > 1:  # the rows without the outlier: ~3e-5 relative
        assert (out[:-1] - exact[:-1]).norm() / exact[:-1].norm() < 2e-4


@pytest.mark.parametrize("groups", [1, 2, 3, 7, 17, 18, 19, 24, 34, 35])
def test_int4_gemv_every_group_count(groups):
    """The int4 loop takes groups in pairs, 16 groups' scales at a time (a short last chunk
    masked), and an odd count's last group alone: every split of K = 32 x groups (SmolLM2's are
    18 and 48) gives W . x' to float32 rounding, float32 and bf16 rows (the int16 path below
    `BF16_GEMV_MIN_TOKENS` rows), as `test_gemv_matches_dequantized_matmul` checks."""
    k = 32 * groups
    gen = torch.Generator().manual_seed(groups)
    blocks = GemvBlocks.from_int4(int4_from_float(torch.randn(24, k, generator=gen) * 0.05))
    wd, terms = blocks_weight(blocks)
    x = torch.randn(4, k, generator=gen)
    for xs in (x[:1], x[:3], x, x.bfloat16()):
        out = blocks(xs.contiguous()).double()
        rounded = rounded_activations(xs.float())
        ref = rounded @ wd.T
        tol = (groups + 16) * 2**-24 * (rounded.abs() @ terms.T)
        if xs.dtype == torch.bfloat16:  # the result rounded once to bf16
            tol = tol + ref.abs() * 2**-8
        assert ((out - ref).abs() <= tol).all(), (xs.dtype, ((out - ref).abs() / tol).max())


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf"), 1e-36])
def test_gemv_nonfinite_and_tiny_groups(qkv, special):
    """A NaN or an infinity in a row makes that row's outputs NaN (float32 arithmetic would make
    them NaN or infinite), never a finite value; a group of values too small for a finite int16
    scale (max < ~1e-34) counts as zeros. Other rows are unaffected."""
    qtype, parts, w = qkv
    lin = quant.build_linear("qkv", parts, "auto", torch.float32)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(11))
    clean = lin.gemv(x)
    x[1, 40] = special
    if special == 1e-36:
        x[1, 32:64] = 1e-36
    out = lin.gemv(x)
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])
    if special == 1e-36:
        zeroed = x.clone()
        zeroed[1, 32:64] = 0.0
        assert torch.equal(out[1], lin.gemv(zeroed)[1])
    else:
        assert out[1].isnan().all()


def test_gemv_rows_do_not_depend_on_the_batch(qkv):
    """Row i is bitwise the same for every M (row tiles of 4 and their remainders) and thread
    count: the property the engine's invariance tests rely on."""
    qtype, parts, _ = qkv
    lin = quant.build_linear("qkv", parts, "auto", torch.float32)
    assert lin.gemv is not None and lin.gemv.kind == ("q8_0" if qtype == "Q8_0" else "int4")
    x = torch.randn(23, K, generator=torch.Generator().manual_seed(8))
    full = lin.gemv(x)
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, threads}:
            torch.set_num_threads(n_threads)
            for m in (1, 2, 3, 4, 5, 9, 22):
                assert torch.equal(lin.gemv(x[:m].contiguous()), full[:m]), (qtype, m, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_float32_calls_route_to_the_gemv_then_to_the_dense_copy(qkv):
    """float32: up to gemv_max_tokens rows on the GEMV, from dense_min_tokens on the float32
    copy (no row count left to torch's bf16-input kernels); bf16 inputs of this model's linears
    reach the GEMV in bf16 (the blocks are there) from `BF16_GEMV_MIN_TOKENS` to
    `BF16_GEMV_MAX_TOKENS` rows, as a bf16 model's do."""
    _, parts, w = qkv
    lin = quant.build_linear("qkv", parts, "auto", torch.float32)
    assert lin.gemv_max_tokens + 1 == lin.dense_min_tokens == quant.dense_min_tokens(torch.float32)
    x = torch.randn(lin.dense_min_tokens, K, generator=torch.Generator().manual_seed(9))
    small = x[: lin.gemv_max_tokens]
    assert torch.equal(lin(small), lin.gemv(small))
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.dense))
    torch.testing.assert_close(lin.dense, w, atol=1e-6, rtol=0)  # the exact GGUF values
    bias = torch.randn(88)
    assert torch.equal(lin(small, bias), lin.gemv(small) + bias)
    rows = small[: quant.BF16_GEMV_MAX_TOKENS].bfloat16()
    assert torch.equal(lin(rows), lin.gemv(rows))
    bare = QuantLinear(lin.kind, lin.weight, lin.scales, lin.shape, dense=lin.dense)
    assert quant.nbytes(lin) == quant.nbytes(bare) + lin.gemv.nbytes()


def test_bf16_gemv_matches_bf16_weights_and_rows_do_not_depend_on_the_batch(qkv):
    """bf16 activations: with AVX512-BF16 the kernel multiplies them as they are with each weight
    rounded to bf16 (fma(q, scale, offset) in float32, then to nearest even: a dense bf16 copy's
    values but for a rare last bit), float32 sums, one rounding of the result, from 5 rows
    (`BF16_GEMV_MIN_TOKENS`); fewer rows, and every row without AVX512-BF16, are read exactly
    into the int16 path and the float32 result rounded once. Either way the result matches the
    bf16 weights' product to bf16 rounding, and row i is bitwise the same at every M on each side
    of 5 rows (row tiles of 6 and 4) and thread count
    (`test_bf16_gemv_short_blocks_and_thread_splits`: a short last block, a K that splits over
    threads)."""
    qtype, parts, _ = qkv
    blocks = gguf_blocks(qtype, parts)
    wd, _ = blocks_weight(blocks)
    x = torch.randn(23, K, generator=torch.Generator().manual_seed(12)).bfloat16()
    out = blocks(x)
    assert out.dtype == torch.bfloat16 and out.shape == (23, 88)
    ref = x.double() @ wd.bfloat16().double().T
    err = (out.double() - ref).abs() / (x.double().abs() @ wd.abs().T)
    assert err.max() < 2**-8, err.max()  # the output's bf16 rounding, relative to the terms
    int16 = blocks(x.float()).bfloat16()
    if not gemv_blocks.gemv_takes_bf16():
        assert torch.equal(out, int16)
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, threads}:
            torch.set_num_threads(n_threads)
            for m in (1, 2, 4, 5, 6, 7, 13, 22):
                want = (out if m >= gemv_blocks.BF16_GEMV_MIN_TOKENS else int16)[:m]
                assert torch.equal(blocks(x[:m].contiguous()), want), (qtype, m, n_threads)
    finally:
        torch.set_num_threads(threads)
    nan = x.clone()
    nan[3, 40] = float("nan")
    got = blocks(nan)
    assert got[3].isnan().all() and torch.equal(got[:3], out[:3])


@pytest.mark.parametrize("kind", ["int4", "q8_0"])
def test_bf16_gemv_short_blocks_and_thread_splits(kind):
    """N = 29 (the last block of 4 weight rows is short: it repeats its last row) and K = 4096
    (enough weights per row that N splits over threads): every row the same at every M (row tiles
    of 6 and 4 and every remainder; bf16 on either side of `BF16_GEMV_MIN_TOKENS` rows) and
    thread count, in bf16 and float32."""
    w = torch.randn(29, 4096, generator=torch.Generator().manual_seed(13)) * 0.05
    if kind == "int4":
        blocks = GemvBlocks.from_int4(int4_from_float(w))
    else:
        q8, s8 = int8_from_float(w)
        blocks = GemvBlocks("q8_0", q8, s8[:, None].expand(29, 4096 // 32).contiguous())
    x = torch.randn(14, 4096, generator=torch.Generator().manual_seed(14))
    threads = torch.get_num_threads()
    try:
        for xs in (x, x.bfloat16()):
            torch.set_num_threads(threads)
            full = blocks(xs)
            few = blocks(xs[: gemv_blocks.BF16_GEMV_MIN_TOKENS - 1])  # bf16: the int16 path
            for n_threads in {1, 2, threads}:
                torch.set_num_threads(n_threads)
                for m in range(1, 14):
                    want = (full if m >= gemv_blocks.BF16_GEMV_MIN_TOKENS else few)[:m]
                    assert torch.equal(blocks(xs[:m].contiguous()), want), (m, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_bf16_linears_route_to_the_gemv_where_it_takes_bf16(qkv):
    """bf16 activations: `build_linear` keeps GEMV blocks where `gemv_takes_bf16`, none
    elsewhere (int4 stays on torch's int4 kernel; Q8_0 blocks come only for a tied LM head, over
    the embedding's own arrays: `QuantLinear.read_q8_0_blocks`). int4 calls of
    `BF16_GEMV_MIN_TOKENS` to `BF16_GEMV_MAX_TOKENS` rows run on the blocks in bf16, fewer and
    more (below the dense copy's threshold) torch's int4 kernel. Q8_0 calls run on the blocks at
    every row count: below `BF16_GEMV_MIN_TOKENS` rows the int16 path (bf16 read exactly: the
    float32 path's result rounded once to bf16), from there the path the linear measured on its
    first such call (`bf16_gemv_pays`; set the other way, the calls follow). So each row is the
    same at every M within each range (at every M where the CPU lacks AVX512-BF16: both GEMV
    paths are then the int16 one); without a dense copy every row count from the threshold runs
    on the blocks."""
    qtype, parts, w = qkv
    lin = quant.build_linear("qkv", parts, "auto", torch.bfloat16)
    assert (lin.gemv is not None) == gemv_blocks.gemv_takes_bf16()
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(10)).bfloat16()
    few = x[: quant.DENSE_MIN_TOKENS - 1]
    first, top = gemv_blocks.BF16_GEMV_MIN_TOKENS, quant.BF16_GEMV_MAX_TOKENS
    assert 2 < first <= top < len(few)
    if lin.gemv is None:
        assert torch.equal(lin(few), lin._kernel(few))
        if qtype != "Q8_0":
            return
        lin.read_q8_0_blocks(GemvBlocks.from_q8_0(parts))
    out = lin.gemv(few)  # the bf16 GEMV where the CPU has AVX512-BF16
    assert out.dtype == torch.bfloat16
    int16_all = lin.gemv(few.float()).bfloat16()
    if lin.gemv.kind == "q8_0":
        got = lin(few)  # measures, once
        pays = lin._bf16_gemv_pays
        assert pays is not None
        want = out if pays else int16_all
        assert torch.equal(got, want)
        for m in range(first, len(few)):
            assert torch.equal(lin(few[:m]), want[:m]), m
        lin._bf16_gemv_pays = not pays
        assert torch.equal(lin(few), int16_all if pays else out)
        lin._bf16_gemv_pays = pays
    else:
        for m in range(first, top + 1):
            assert torch.equal(lin(few[:m]), out[:m]), m
        for m in range(top + 1, len(few) + 1):
            assert torch.equal(lin(few[:m]), lin._kernel(few[:m])), m
    below = lin(few[: first - 1])
    int16 = lin.gemv(few[: first - 1].float()).bfloat16()
    assert torch.equal(lin.gemv(few[: first - 1]), int16)  # bf16 rows read exactly
    if lin.gemv.kind == "q8_0":
        assert torch.equal(below, int16)
    else:
        assert torch.equal(below, lin._kernel(few[: first - 1]))
    for m in range(1, first - 1):
        assert torch.equal(lin(few[:m]), below[:m]), m
    if not gemv_blocks.gemv_takes_bf16():
        assert torch.equal(int16, out[: first - 1])
    for y in (out, below, int16):
        torch.testing.assert_close(y.float(), few[: len(y)].float() @ w.T, atol=2e-2, rtol=2e-2)
    if qtype == "Q8_0":  # float16 calls read the blocks too (through float32: exact)
        assert torch.equal(lin(few.half()), lin.gemv(few.float()).half())
        bare = QuantLinear(lin.kind, lin.weight, lin.scales, lin.shape)  # no dense copy
        bare.read_q8_0_blocks(GemvBlocks.from_q8_0(parts))
        got = bare(x)  # 40 rows: still the blocks
        pays = bare._bf16_gemv_pays
        assert torch.equal(got, bare.gemv(x) if pays else bare.gemv(x.float()).bfloat16())


@pytest.fixture(scope="module")
def q8_0_qkv(tmp_path_factory):
    """The fused qkv parts as Q8_0 blocks."""
    path = write_gguf(tmp_path_factory.mktemp("q8") / "q.gguf", "Q8_0", np.random.default_rng(8))
    kept = load_gguf_weights(gguf.GGUFReader(str(path)), CONFIG, path, keep_quantized=True)
    return [kept[n] for n in QKV]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_linear_of_a_big_model_runs_tiles_and_requantizes_on_need(
    q8_0_qkv, dtype, monkeypatch
):
    """A Q8_0 linear of a model whose dense copies would not fit (`dense_copies=False`) holds
    its blocks only: calls past its GEMV's rows multiply dequantized tiles (32 outputs a tile
    here, so three of them and a short one), equal to dense GEMMs on the same tiles; smaller
    calls take the GEMV as the copy's linear does; the per-channel int8 weights of torch's kernel
    are made on first need, equal to requantizing the dequantized blocks. bf16 calls: the routes
    `build_linear` gives where bf16 is native, checked on any CPU."""
    parts = q8_0_qkv
    monkeypatch.setattr(kquant, "KQUANT_TILE_ROWS", 32)
    built = quant.build_linear("qkv", parts, "auto", dtype, dense_copies=False)
    assert built.dense is None
    if quant.dense_copy_dtype(dtype) is None:  # bf16 without native bf16: torch's kernel
        assert not built.tiled and built.gemv is None
    else:
        assert built.tiled and built._weight is None and built._scales is None
        assert quant.nbytes(built) == built.gemv.nbytes()
    blocks = GemvBlocks.from_q8_0(parts)
    lin = QuantLinear.from_q8_0_blocks(tiled=True, **quant._routes(dtype, None, blocks))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(lin.tile_min_tokens, K, generator=gen).to(dtype)
    bias = torch.randn(88, generator=gen).to(dtype)
    w = torch.cat([dequantize(p) for p in parts])
    tiles = [w[r : r + 32].to(dtype) for r in range(0, 88, 32)]
    want = torch.cat([F.linear(x, t, bias[r * 32 : r * 32 + 32]) for r, t in enumerate(tiles)], 1)
    assert torch.equal(lin(x, bias), want)
    few = x[: lin.tile_min_tokens - 1]
    assert torch.equal(lin(few), QuantLinear.from_q8_0_blocks(gemv=blocks)(few))
    assert lin._weight is None  # no call so far needed torch's kernel
    q, scale = int8_from_float(w)
    assert torch.equal(lin.weight, q) and torch.equal(lin.scales, scale.to(quant.KERNEL_DTYPE))


def test_dense_copies_fit_counts_the_q8_0_linears_in_the_copies_dtype():
    """`dense_copies_fit`: Q8_0 weights times the copy's bytes against `DENSE_COPY_MAX_BYTES`;
    other tensors do not count, nor an embedding with a head of its own; a dtype that keeps no
    copy always fits."""

    def q8(n: int, k: int) -> GGUFQuantTensor:
        blocks = np.broadcast_to(np.zeros(1, np.uint8), (n, k // 32 * 34))  # no memory
        return GGUFQuantTensor("w", "Q8_0", blocks, (n, k))

    limit = quant.DENSE_COPY_MAX_BYTES // 4  # float32 weights at the limit
    at_limit = {"a.weight": q8(limit // 4096, 4096), "norm.weight": torch.zeros(4, 4)}
    assert quant.dense_copies_fit(at_limit, torch.float32)
    over = {**at_limit, "model.embed_tokens.weight": q8(1, 32)}  # tied: it is the head
    assert not quant.dense_copies_fit(over, torch.float32)
    assert quant.dense_copies_fit({**over, "lm_head.weight": torch.zeros(1, 32)}, torch.float32)
    twice = {**at_limit, "b.weight": q8(limit // 4096, 4096)}
    assert quant.dense_copies_fit(twice, torch.bfloat16)  # 2-byte copies, or none at all
    keeps_copy = quant.dense_copy_dtype(torch.bfloat16) is not None
    fits = quant.dense_copies_fit({**twice, "c.weight": q8(1, 32)}, torch.bfloat16)
    assert fits == (not keeps_copy)


def test_dense_copy_only_where_bf16_is_native(qkv):
    """bf16 activations keep a dense bf16 copy for big calls only on AMX/AVX512-BF16 CPUs; on an
    AVX2-only CPU its GEMMs are slower than the int4 kernel at every M (scripts/bench_quant.py)."""
    _, parts, _ = qkv
    lin = quant.build_linear("qkv", parts, "auto", torch.bfloat16)
    assert (lin.dense is not None) == cpu_has_fast_bf16()
    assert quant.dense_copy_dtype(torch.float32) == torch.float32  # on every CPU


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(2, K).double(),), "float32 or bfloat16"),
        ((torch.randn(2, K + 1),), "multiple of 32"),
        ((torch.randn(2, 2 * K),), "qs must be"),
    ],
)
def test_gemv_rejects_bad_arguments(qkv, args, message):
    qtype, parts, _ = qkv
    blocks = quant.build_linear("qkv", parts, "auto", torch.float32).gemv
    with pytest.raises(RuntimeError, match=message):
        blocks(*args)


@pytest.mark.parametrize("groups", [8, 18, 19, 48])
def test_int4_block_order_keeps_every_weight_and_the_op_checks_the_order(groups):
    """`int4_block_order` only moves nibbles (every full block of 8 groups permuted, the last
    G % 8 groups in place: the multiset of each row's 4-bit codes unchanged, the tail bytes
    identical); blocks prepared ahead of their first call (`prepare`, idempotent) give exactly
    the results of blocks prepared by it; the op refuses weights in an order this build does not
    read, rather than multiplying them wrongly."""
    k = 32 * groups
    gen = torch.Generator().manual_seed(100 + groups)
    groups4 = int4_from_float(torch.randn(40, k, generator=gen) * 0.05)
    natural = GemvBlocks.from_int4(groups4)
    ordered = gemv_blocks.int4_block_order(natural.qs)
    assert ordered.shape == natural.qs.shape and ordered.dtype == torch.uint8
    full = groups // 8 * 8 * 16
    assert torch.equal(ordered[:, full:], natural.qs[:, full:])

    def codes(qs):
        return torch.cat([qs & 15, qs >> 4], dim=1).sort(dim=1).values

    assert torch.equal(codes(ordered), codes(natural.qs))
    if groups >= 8:
        assert not torch.equal(ordered[:, :full], natural.qs[:, :full])
    x = torch.randn(5, k, generator=gen)
    lazy = GemvBlocks.from_int4(groups4)
    ahead = GemvBlocks.from_int4(groups4)
    ahead.prepare()
    ahead.prepare()
    want = gemv_blocks.int4_kernel_block_groups()
    assert ahead.block_groups == want and lazy.block_groups == 1
    assert torch.equal(ahead(x), lazy(x)) and lazy.block_groups == want
    wrong = 1 if want != 1 else gemv_blocks.INT4_BLOCK_GROUPS
    with pytest.raises(RuntimeError, match="this build reads blocks of"):
        torch.ops.laneserve.int4_gemv(x, ahead.qs, ahead.scale, ahead.offset, wrong)


def test_int4_block_order_places_each_nibble_by_its_definition():
    """Byte i of chunk c of block b holds element 2 c + i % 2 of group 8 b + i // 2 in its low
    nibble and element 2 (c + 8) + i % 2 in its high one; the tail groups keep the GGUF's bytes
    (byte j of a group: element j low, 16 + j high). Checked element by element against the
    definition, on every CPU (the kernel reads this order only where it was built for AVX2)."""
    gen = torch.Generator().manual_seed(21)
    n, groups = 3, 19  # two full blocks and a tail of 3
    q = torch.randint(0, 16, (n, groups, 32), generator=gen, dtype=torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, groups * 16)
    ordered = gemv_blocks.int4_block_order(qs)
    for row in range(n):
        for b in range(groups // 8):
            for c in range(8):
                for i in range(16):
                    byte = int(ordered[row, b * 128 + c * 16 + i])
                    g = 8 * b + i // 2
                    assert byte & 15 == q[row, g, 2 * c + i % 2]
                    assert byte >> 4 == q[row, g, 2 * (c + 8) + i % 2]
    assert torch.equal(ordered[:, 16 * 16 :], qs[:, 16 * 16 :])


def test_int4_gemv_rows_do_not_depend_on_the_batch_with_full_blocks_and_a_tail():
    """K = 576 (SmolLM2's: 18 groups, two blocks of 8 and a tail of 2) and N enough to split over
    threads: row i is bitwise the same at every M (row tiles of 4 and remainders) and thread
    count, float32 and bf16, and equals W . x' as `test_gemv_matches_dequantized_matmul` bounds."""
    k = 576
    gen = torch.Generator().manual_seed(22)
    blocks = GemvBlocks.from_int4(int4_from_float(torch.randn(200, k, generator=gen) * 0.05))
    # bf16 rows read exactly into the int16 path where there is no bf16 one
    rows_at_every_m(
        blocks, torch.randn(22, k, generator=gen), bf16=not gemv_blocks.gemv_takes_bf16()
    )


def rows_at_every_m(blocks: GemvBlocks, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """`blocks(x)` (returned), checked against W . x' within the float32 rounding bound of
    `test_gemv_matches_dequantized_matmul`; row i bitwise the same at every M (row tiles and
    remainders) and thread count; with `bf16`, bf16 rows equal to float32 ones rounded once."""
    wd, terms = blocks_weight(blocks)  # before the first call puts the weights in the block order
    full = blocks(x)
    rounded = rounded_activations(x)
    tol = (x.shape[1] // 32 + 16) * 2**-24 * (rounded.abs() @ terms.T)
    assert ((full.double() - rounded @ wd.T).abs() <= tol).all()
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, threads}:
            torch.set_num_threads(n_threads)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 22):
                assert torch.equal(blocks(x[:m].contiguous()), full[:m]), (m, n_threads)
                if bf16:
                    xb = x[:m].bfloat16()
                    assert torch.equal(blocks(xb), blocks(xb.float()).bfloat16()), m
    finally:
        torch.set_num_threads(threads)
    return full


def test_q8_0_block_order_places_each_weight_by_its_definition():
    """Byte i of chunk c of block b holds element 2 c + i % 2 of group 16 b + i // 2; the tail
    groups keep the GGUF's bytes. Checked element by element, on every CPU (the kernel reads
    this order only where it was built for AVX-512BW)."""
    gen = torch.Generator().manual_seed(31)
    n, groups = 3, 35  # two full blocks of 16 and a tail of 3
    qs = torch.randint(-127, 128, (n, groups * 32), generator=gen, dtype=torch.int8)
    ordered = gemv_blocks.q8_0_block_order(qs)
    assert ordered.shape == qs.shape and ordered.dtype == torch.int8
    for row in range(n):
        for b in range(groups // 16):
            for c in range(16):
                for i in range(32):
                    g = 16 * b + i // 2
                    want = qs[row, g * 32 + 2 * c + i % 2]
                    assert ordered[row, b * 512 + c * 32 + i] == want
    assert torch.equal(ordered[:, 32 * 32 :], qs[:, 32 * 32 :])


@pytest.mark.parametrize("groups", [3, 16, 18, 48])
def test_q8_0_block_copy_rows_match_the_gguf_order_and_do_not_depend_on_the_batch(groups):
    """A tied head's Q8_0 blocks (`read_q8_0_blocks` asks for the copy) get their block-order
    copy where the kernel reads it (`prepare`, also on the first call; idempotent); other Q8_0
    blocks never do. The int16 path's rows through the copy equal W . x' within the float32
    rounding bound of `test_gemv_matches_dequantized_matmul` and the GGUF order's rows to ~1e-6;
    row i is bitwise the same at every M (tiles of 4 and, in the block order, of 5-8) and thread
    count; bf16 calls that run the bf16 path read the GGUF's order (the op refuses the copy
    there), and the op refuses an order the build does not read."""
    k = 32 * groups
    gen = torch.Generator().manual_seed(40 + groups)
    q8, s8 = int8_from_float(torch.randn(200, k, generator=gen) * 0.05)
    d = s8[:, None].expand(200, groups).contiguous()
    plain = GemvBlocks("q8_0", q8, d)
    plain.prepare()
    assert plain.qs_blocks is None  # no copy unless asked for
    head = QuantLinear.from_int8(q8, s8)
    head.read_q8_0_blocks(GemvBlocks("q8_0", q8, d))
    blocks = head.gemv
    want = gemv_blocks.q8_0_kernel_block_groups()
    x = torch.randn(22, k, generator=gen)
    full = rows_at_every_m(blocks, x)
    assert (blocks.qs_blocks is not None) == (want > 1) and blocks.qs is q8
    if want > 1:
        copy = blocks.qs_blocks
        blocks.prepare()
        assert blocks.qs_blocks is copy
        assert torch.equal(copy, gemv_blocks.q8_0_block_order(q8))
    gguf_order = torch.ops.laneserve.q8_0_gemv(x, q8, d, 1)
    assert ((full - gguf_order).abs() <= 1e-5 * gguf_order.abs().max()).all()
    if want > 1:
        xb = x[:6].bfloat16()
        bf16_path = gemv_blocks.gemv_takes_bf16()
        assert torch.equal(
            blocks(xb), torch.ops.laneserve.q8_0_gemv(xb, q8, d, 1 if bf16_path else want)
        )
        if bf16_path:
            with pytest.raises(RuntimeError, match="GGUF's order"):
                torch.ops.laneserve.q8_0_gemv(xb, blocks.qs_blocks, d, want)
    with pytest.raises(RuntimeError, match="this build reads blocks of"):
        torch.ops.laneserve.q8_0_gemv(x, q8, d, 7)
