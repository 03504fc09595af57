"""The AMX matmuls (kernels/csrc/amx_matmul.cpp) against the bf16 weights' product, their layout
(`gemv_blocks.amx_order`) by its definition, and the routing of bf16 linears to them.

They run only on a CPU with AMX-BF16 (Sapphire Rapids and later); elsewhere `amx_usable()` is
false, the ops refuse, and the tests that need the tiles skip with that reason.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from laneserve.gpu_worker import gemv_blocks, gguf_blocks
from laneserve.gpu_worker import quantization as quant
from laneserve.gpu_worker.gemv_blocks import GemvBlocks
from laneserve.kernels import cpu_ext

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def built():
    assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


needs_amx = pytest.mark.skipif(
    not gemv_blocks.amx_usable(),
    reason="AMX matmuls not usable here (no AMX-BF16, the kernel refused it, or LANESERVE_AMX=0)",
)


def random_blocks(kind: str, n: int, k: int, seed: int) -> GemvBlocks:
    """Blocks of a bf16 model's linear (`use_amx`, as `build_linear` sets it for bf16)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "int4":
        blocks = GemvBlocks.from_int4(gguf_blocks.int4_from_float(w))
    else:
        q8, s8 = gguf_blocks.int8_from_float(w)
        scale = (s8[:, None] * (1 + torch.rand(n, k // 32, generator=g))).contiguous()
        blocks = GemvBlocks("q8_0", q8, scale)  # a scale per group, as Q8_0 blocks have
    blocks.use_amx = True
    return blocks


def weights(blocks: GemvBlocks) -> torch.Tensor:
    """W in float32 from the blocks' own arrays (GGUF order)."""
    n = blocks.qs.shape[0]
    if blocks.kind == "q8_0":
        return (blocks.qs.float().view(n, -1, 32) * blocks.scale[..., None]).view(n, -1)
    b = blocks.qs.to(torch.int32).view(n, -1, 16)
    q = torch.cat([b & 15, b >> 4], dim=2).float()
    return (q * blocks.scale[..., None] + blocks.offset[..., None]).view(n, -1)


@pytest.mark.parametrize("kind", ["int4", "q8_0"])
def test_amx_order_places_each_weight_by_its_definition(kind):
    """Tile row r of block b and group g: its first half the pairs (k = 32 g + 2 r + i) of outputs
    16 b + j // 2, its second those of 16 b + 8 + j // 2 (int4: the low and the high nibbles of
    the same bytes); the scales (and offsets) of the block's 16 outputs per group."""
    blocks = random_blocks(kind, 48, 96, seed=1)
    qa, sa = gemv_blocks.amx_order(kind, blocks.qs, blocks.scale, blocks.offset)
    n, k = 48, 96
    if kind == "int4":
        b = blocks.qs.to(torch.int32).view(n, -1, 16)
        q = torch.cat([b & 15, b >> 4], dim=2).view(n, k)
        assert qa.shape == (3, 3, 16, 16) and qa.dtype == torch.uint8
        lo, hi = qa.to(torch.int32) & 15, qa.to(torch.int32) >> 4
    else:
        q = blocks.qs.to(torch.int32)
        assert qa.shape == (3, 3, 16, 32) and qa.dtype == torch.int8
        lo, hi = qa[..., :16].to(torch.int32), qa[..., 16:].to(torch.int32)
    for blk, g, r, j in [(0, 0, 0, 0), (1, 2, 15, 15), (2, 1, 7, 6), (0, 2, 3, 9)]:
        kk = 32 * g + 2 * r + j % 2
        assert lo[blk, g, r, j] == q[16 * blk + j // 2, kk]
        assert hi[blk, g, r, j] == q[16 * blk + 8 + j // 2, kk]
    assert torch.equal(sa[1, 2, :16], blocks.scale[16:32, 2])
    if kind == "int4":
        assert sa.shape == (3, 3, 32) and torch.equal(sa[2, 0, 16:], blocks.offset[32:48, 0])
    else:
        assert sa.shape == (3, 3, 16)


@needs_amx
@pytest.mark.parametrize("kind", ["int4", "q8_0"])
@pytest.mark.parametrize("n", [32, 80, 112])
def test_amx_matches_bf16_weights_and_rows_do_not_depend_on_the_batch(kind, n):
    """The result equals x times the weights rounded to bf16 (float32 sums, one rounding of the
    output) for M across the 16-row tile (1, 5, 16, 17, 40, 70: one tile dequantized per product
    up to 16 rows, a pass's tiles dequantized once and read back by every 16-row chunk above) and
    N = 32 / 80 / 112 (passes of 2, 4 + 1 and 4 + 3 blocks); row i is bitwise the same at every M
    and thread count; a NaN stays in its row."""
    blocks = random_blocks(kind, n, 160, seed=2)
    qa, sa = gemv_blocks.amx_order(kind, blocks.qs, blocks.scale, blocks.offset)
    op = torch.ops.laneserve.int4_amx if kind == "int4" else torch.ops.laneserve.q8_0_amx
    x = torch.randn(70, 160, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = op(x, qa, sa)
    assert out.dtype == torch.bfloat16 and out.shape == (70, n)
    w = weights(blocks)
    ref = x.double() @ w.bfloat16().double().T
    err = (out.double() - ref).abs() / (x.double().abs() @ w.abs().double().T)
    assert err.max() < 2**-8, err.max()  # the output's bf16 rounding, relative to the terms
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, threads}:
            torch.set_num_threads(n_threads)
            for m in (1, 5, 16, 17, 40, 70):
                assert torch.equal(op(x[:m].contiguous(), qa, sa), out[:m]), (m, n_threads)
            assert torch.equal(op(x[20:37].contiguous(), qa, sa), out[20:37])
    finally:
        torch.set_num_threads(threads)
    nan = x.clone()
    nan[18, 40] = float("nan")
    got = op(nan, qa, sa)
    assert got[18].isnan().all() and torch.equal(got[:18], out[:18])
    assert torch.equal(got[19:], out[19:])


@needs_amx
@pytest.mark.parametrize("kind", ["int4", "q8_0"])
def test_amx_across_shapes_buffers_and_thread_splits(kind):
    """Calls of other shapes in a row, so the per-thread pass buffer grows and is reused: K
    from 160 to 2,048 and back, a K past the buffer's 1 MiB (8,224: dequantized again per 16
    rows), one pass only (fewer passes than threads: the 16-row chunks split among threads) and
    M up to 512. Each result is within the bf16 bound of the reference, and every row equals
    that row computed alone."""
    threads = torch.get_num_threads()
    try:
        for n, k, m in ((48, 160, 70), (80, 2048, 512), (16, 8224, 40), (64, 160, 300),
                        (16, 576, 512)):  # fmt: skip
            blocks = random_blocks(kind, n, k, seed=n + k)
            qa, sa = gemv_blocks.amx_order(kind, blocks.qs, blocks.scale, blocks.offset)
            op = torch.ops.laneserve.int4_amx if kind == "int4" else torch.ops.laneserve.q8_0_amx
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            w = weights(blocks)
            for n_threads in {1, max(2, threads)}:
                torch.set_num_threads(n_threads)
                out = op(x, qa, sa)
                ref = x.double() @ w.bfloat16().double().T
                err = (out.double() - ref).abs() / (x.double().abs() @ w.abs().double().T)
                assert err.max() < 2**-8, (n, k, m, n_threads, err.max())
                for i in (0, 17, m - 1):
                    assert torch.equal(op(x[i : i + 1].contiguous(), qa, sa)[0], out[i]), (
                        n, k, m, n_threads, i,
                    )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_amx_ops_reject_bad_arguments():
    blocks = random_blocks("int4", 32, 64, seed=4)
    qa, sa = gemv_blocks.amx_order("int4", blocks.qs, blocks.scale, blocks.offset)
    x = torch.randn(5, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.laneserve.int4_amx(x.float(), qa, sa)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.laneserve.int4_amx(torch.randn(5, 96).bfloat16(), qa, sa)
    with pytest.raises(RuntimeError, match="qa must be"):
        torch.ops.laneserve.q8_0_amx(x, qa, sa)  # int4 tiles to the Q8_0 op


@needs_amx
@pytest.mark.parametrize("kind", ["int4", "q8_0"])
def test_bf16_calls_route_to_amx_between_its_thresholds(kind):
    """GEMV blocks whose N is a multiple of 16 get their AMX copy on first use; bf16 calls of
    `AMX_MIN_TOKENS` to `AMX_MAX_TOKENS` rows run it (a `QuantLinear` too, ahead of its dense
    copy's threshold; a part of a bigger call as the whole), fewer rows and float32 calls the
    GEMV paths as before; blocks whose N is not a multiple of 16 keep no copy."""
    blocks = random_blocks(kind, 64, 128, seed=5)
    x = torch.randn(gemv_blocks.AMX_MAX_TOKENS + 1, 128, generator=torch.Generator().manual_seed(6))
    xb = x.bfloat16()
    lo, hi = gemv_blocks.AMX_MIN_TOKENS, gemv_blocks.AMX_MAX_TOKENS
    assert not blocks.takes_amx(xb[: lo - 1]) and not blocks.takes_amx(x[:lo])
    assert blocks.takes_amx(xb[:lo]) and blocks.amx_qs is not None
    op = torch.ops.laneserve.int4_amx if kind == "int4" else torch.ops.laneserve.q8_0_amx
    amx = op(xb, blocks.amx_qs, blocks.amx_scale)
    for m in (lo, hi):
        assert torch.equal(blocks(xb[:m]), amx[:m]), m
    few = xb[: lo - 1]
    assert torch.equal(blocks(few), blocks(few.float()).bfloat16())  # the int16 path
    assert not blocks.takes_amx(xb)  # past the range: the GEMVs
    torch.testing.assert_close(blocks(xb).float(), amx.float(), atol=2e-2, rtol=2e-2)
    if kind == "int4":
        lin = quant.QuantLinear.from_int4(
            gguf_blocks.int4_from_float(weights(blocks)),
            dense=weights(blocks).bfloat16(),
            dense_min_tokens=lo + 1,
            gemv=blocks,
        )
        assert torch.equal(lin(xb[: lo + 3]), amx[: lo + 3])  # not the dense copy
        assert torch.equal(lin(xb[: lo - 1]), lin._kernel(xb[: lo - 1]))
        # a part of a bigger call takes the whole's kernel (`rows`: a split gate/up's halves);
        # a dense copy of twice the weights tells the two kernels apart
        twice = quant.QuantLinear.from_int4(
            gguf_blocks.int4_from_float(weights(blocks)),
            dense=(2 * weights(blocks)).bfloat16(),
            dense_min_tokens=lo + 1,
            gemv=blocks,
        )
        part = xb[: lo + 3]
        whole = quant.linear(part, twice, rows=hi + 1).float()  # the dense copy's kernel
        torch.testing.assert_close(whole, 2 * amx[: lo + 3].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(quant.linear(part, twice, rows=lo + 3), amx[: lo + 3])
    odd = random_blocks(kind, 72, 128, seed=7)
    assert not odd.takes_amx(xb[:lo]) and odd.amx_qs is None


@pytest.mark.parametrize("kind", ["int4", "q8_0"])
def test_only_bf16_models_get_amx_copies(kind):
    """The builders ask for the AMX copy for bf16 models only: `build_linear`'s int4 GEMV blocks
    and a tied LM head's Q8_0 blocks (`read_q8_0_blocks`, by its dense copy's dtype). A float32
    model's blocks never get one (no call could read it); a bf16 model's get theirs on the first
    call in range, where the matmuls run, and give the float32 model's result to bf16 rounding."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(9)) * 0.05
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(10))
    lins = {}
    for dtype in (torch.float32, torch.bfloat16):
        if kind == "int4":
            lin = quant.build_linear("w", [w], "int4", dtype)
        else:
            lin = quant.build_linear("head", [w], "int8", dtype)
            q8, s8 = gguf_blocks.int8_from_float(w)
            lin.read_q8_0_blocks(GemvBlocks("q8_0", q8, s8[:, None].expand(64, 4).contiguous()))
        lin(x.to(dtype))
        lins[dtype] = lin
    f32, bf16 = lins[torch.float32], lins[torch.bfloat16]
    assert f32.gemv is not None and not f32.gemv.use_amx and f32.gemv.amx_qs is None
    if bf16.gemv is None or bf16.dense is None:  # no AVX512-BF16 / no fast bf16: no AMX either
        assert not gemv_blocks.amx_usable()
        return
    assert bf16.gemv.use_amx
    assert (bf16.gemv.amx_qs is not None) == gemv_blocks.amx_usable()
    torch.testing.assert_close(bf16(x.bfloat16()).float(), f32(x), atol=3e-2, rtol=3e-2)


def test_without_amx_nothing_changes():
    """A block not asked for an AMX copy keeps none; where the C++ op cannot use the tiles it
    refuses with a clear error."""
    blocks = random_blocks("int4", 32, 64, seed=8)
    blocks.use_amx = False
    xb = torch.randn(8, 64).bfloat16()
    assert not blocks.takes_amx(xb) and blocks.amx_qs is None
    if not torch.ops.laneserve.amx_usable():
        qa, sa = gemv_blocks.amx_order("int4", blocks.qs, blocks.scale, blocks.offset)
        with pytest.raises(RuntimeError, match="AMX"):
            torch.ops.laneserve.int4_amx(xb, qa, sa)
