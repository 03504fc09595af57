"""CPU decode attention: the C++ in-place kernel (kernels.cpu_ext) and the PyTorch fallback
against the dense oracle, over ragged (query_len, kv_len) mixes, GQA ratios and a large pool."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_attention

from laneserve.kernels import cpu_ext, reference

# (query_len, kv_len) mixes: long and tiny decodes, a prefill chunk, a decode at a block edge
MIXES = {
    "decode": [(1, 1328), (1, 1), (1, 18), (1, 463), (1, 64), (1, 65)],
    "mixed": [(1, 1328), (5, 18), (129, 463), (1, 1), (1, 200)],
    # the scheduler's order: decodes first (their rows are views, not gathered), then chunks
    "decodes_first": [(1, 1328), (1, 1), (1, 200), (5, 18), (129, 463)],
}
HEADS = [(4, 4), (6, 2), (12, 4), (8, 1)]  # GQA 1, 3, 3, 8
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


@pytest.fixture(params=["cpp", "torch"])
def path(request, monkeypatch) -> str:
    """Run a test on the C++ kernel and again on the PyTorch fallback."""
    if request.param == "cpp":
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler: the extension cannot be built")
        assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"
    else:
        monkeypatch.setitem(cpu_ext._state, "ok", False)
    return request.param


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_match_dense(mix, num_q_heads, num_kv_heads, dtype, path, gen):
    args = make_paged_batch(MIXES[mix], num_q_heads, num_kv_heads, 32, 16, dtype, gen)
    expected = naive_attention(**args)
    got = reference.unified_attention(**args)
    assert got.dtype == dtype and got.shape == args["q"].shape
    torch.testing.assert_close(got.float(), expected, **TOL[dtype])


def test_half_precision_and_head_dim_not_a_multiple_of_16(path, gen):
    args = make_paged_batch([(1, 77), (1, 5), (1, 300)], 6, 3, 40, 8, torch.float16, gen)
    torch.testing.assert_close(
        reference.unified_attention(**args).float(), naive_attention(**args), **TOL[torch.float16]
    )


def test_large_pool_last_blocks(path, gen):
    """Block ids near the end of a 60,000-block pool: offsets must not overflow."""
    args = make_paged_batch(
        [(1, 300), (1, 17), (1, 129)],
        4,
        2,
        32,
        16,
        torch.float32,
        gen,
        num_blocks=60_000,
        use_last_blocks=True,
    )
    assert int(args["block_tables"].max()) == 60_000 - 1
    torch.testing.assert_close(
        reference.unified_attention(**args), naive_attention(**args), **TOL[torch.float32]
    )


def test_strided_cache_and_int64_metadata(path, gen):
    """The model runner's caches are views of one [2, N, bs, Hk, D] tensor; int64 tables work."""
    args = make_paged_batch([(1, 50), (1, 9)], 4, 2, 32, 8, torch.float32, gen)
    kv = torch.stack([args["k_cache"], args["v_cache"]])  # [2, N, bs, Hk, D]
    wide = torch.zeros(*args["k_cache"].shape[:2], 3, 32)  # Hk padded to 3: non-dense heads
    wide[:, :, :2] = args["k_cache"]
    strided = dict(
        args,
        k_cache=wide[:, :, :2],
        v_cache=kv[1],
        seq_lens=args["seq_lens"].long(),
        block_tables=args["block_tables"].long(),
    )
    assert not strided["k_cache"].is_contiguous()
    torch.testing.assert_close(
        reference.unified_attention(**strided), naive_attention(**args), **TOL[torch.float32]
    )


def test_decode_row_does_not_depend_on_the_rest_of_the_batch(path, gen):
    """Bitwise: a sequence's output is the same alone and next to longer and shorter ones."""
    args = make_paged_batch([(1, 40), (1, 700), (1, 3)], 6, 2, 32, 16, torch.bfloat16, gen)
    together = reference.unified_attention(**args)
    alone = dict(
        args,
        q=args["q"][:1],
        cu_seqlens_q=args["cu_seqlens_q"][:2],
        seq_lens=args["seq_lens"][:1],
        block_tables=args["block_tables"][:1],
    )
    if path == "torch":  # the padded fallback masks a longer context: equal to rounding only
        torch.testing.assert_close(reference.unified_attention(**alone), together[:1])
    else:
        assert torch.equal(reference.unified_attention(**alone), together[:1])


@pytest.mark.parametrize("threads", [1, 2])
def test_wide_batch_of_scattered_blocks(path, gen, threads):
    """A batch wide enough that each task takes a whole sequence (while it runs, the C++ kernel
    fetches the next sequence's blocks), ragged lengths from 1 to 600 keys on blocks scattered
    over the pool: every row matches the dense oracle and, bitwise, itself decoded alone."""
    lengths = [1, 600, 16, 17, 250, 3, 129, 64, 1, 431, 95, 33]
    args = make_paged_batch([(1, n) for n in lengths], 6, 2, 64, 16, torch.bfloat16, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = reference.unified_attention(**args)
        last = dict(
            args,
            q=args["q"][-1:],
            cu_seqlens_q=args["cu_seqlens_q"][:2],
            seq_lens=args["seq_lens"][-1:],
            block_tables=args["block_tables"][-1:],
        )
        alone = reference.unified_attention(**last)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.float(), naive_attention(**args), **TOL[torch.bfloat16])
    if path == "cpp":
        assert torch.equal(alone, got[-1:])
