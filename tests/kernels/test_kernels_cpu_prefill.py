"""CPU multi-token attention (prefill chunks, speculative verification rows): the C++ kernel
``laneserve::paged_prefill_attention`` (kernels.cpu_ext) against the dense oracle, and the
invariances the engine relies on (a row does not depend on its chunk or on its batch)."""

from __future__ import annotations

import shutil

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_attention

from laneserve.kernels import cpu_ext, reference

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
# (query_len, kv_len): a fresh prompt, a chunk after a cached prefix, verification rows, a
# prompt of one token, decodes beside them, a chunk ending inside a block and one at its edge;
# (10, 41): with 3 query heads per KV head, row 2 (position 31) sees nothing of the key tile
# from 32 that row 3 (position 32), its partner in the score pass, sees one key of
MIXED = [(300, 300), (37, 290), (5, 64), (1, 1), (1, 513), (130, 130), (9, 33), (2, 2), (10, 41)]


@pytest.fixture(autouse=True)
def built():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the extension cannot be built")
    assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


def _ops_called(args: dict) -> set[str]:
    with torch.profiler.profile() as prof:
        reference.unified_attention(**args)
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_rows_match_dense(num_q_heads, num_kv_heads, dtype, gen):
    args = make_paged_batch(MIXED, num_q_heads, num_kv_heads, 64, 16, dtype, gen)
    got = reference.unified_attention(**args)
    assert got.dtype == dtype and got.shape == args["q"].shape
    torch.testing.assert_close(got.float(), naive_attention(**args), **TOL[dtype])


def test_the_kernel_reads_the_cache_in_place():
    """The multi-token rows go to the C++ kernel: no SDPA, no gather of the context."""
    args = make_paged_batch([(40, 70), (1, 9)], 6, 2, 32, 16, torch.float32, torch.Generator())
    ops = _ops_called(args)
    assert "laneserve::paged_prefill_attention" in ops
    assert not any("scaled_dot_product" in op or op == "aten::index_select" for op in ops)


def test_head_dim_not_a_multiple_of_8_and_block_size_8(gen):
    """The scalar path (no 8-lane slices of the head dim) and keys crossing many blocks."""
    args = make_paged_batch([(50, 77), (3, 5), (1, 20)], 6, 3, 36, 8, torch.float32, gen)
    torch.testing.assert_close(
        reference.unified_attention(**args), naive_attention(**args), **TOL[torch.float32]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_chunk_or_batch(dtype, gen):
    """Bitwise: a 100-token prompt attended whole, in chunks of 37 + 63, and next to other
    sequences gives the same rows (chunked prefill and batch composition change nothing)."""
    whole = make_paged_batch([(100, 100)], 9, 3, 64, 16, dtype, gen)
    out_whole = reference.unified_attention(**whole)
    first = dict(
        whole,
        q=whole["q"][:37],
        cu_seqlens_q=torch.tensor([0, 37], dtype=torch.int32),
        seq_lens=torch.tensor([37], dtype=torch.int32),
    )
    second = dict(
        whole,
        q=whole["q"][37:],
        cu_seqlens_q=torch.tensor([0, 63], dtype=torch.int32),
        seq_lens=torch.tensor([100], dtype=torch.int32),
    )
    assert torch.equal(reference.unified_attention(**first), out_whole[:37])
    assert torch.equal(reference.unified_attention(**second), out_whole[37:])
    # the same prompt as the second sequence of a batch, a longer one before it
    other = make_paged_batch([(200, 260)], 9, 3, 64, 16, dtype, gen)
    offset = other["k_cache"].shape[0]
    batch = {
        "q": torch.cat([other["q"], whole["q"]]),
        "k_cache": torch.cat([other["k_cache"], whole["k_cache"]]),
        "v_cache": torch.cat([other["v_cache"], whole["v_cache"]]),
        "cu_seqlens_q": torch.tensor([0, 200, 300], dtype=torch.int32),
        "seq_lens": torch.tensor([260, 100], dtype=torch.int32),
        "block_tables": torch.full((2, 20), -1, dtype=torch.int32),
        "softmax_scale": whole["softmax_scale"],
    }
    batch["block_tables"][0, :17] = other["block_tables"][0, :17]
    batch["block_tables"][1, :7] = whole["block_tables"][0, :7] + offset
    assert torch.equal(reference.unified_attention(**batch)[200:], out_whole)


def test_bad_metadata_is_a_clear_error(gen):
    args = make_paged_batch([(20, 40)], 4, 2, 32, 16, torch.float32, gen)
    bad_block = dict(args, block_tables=args["block_tables"].clone())
    bad_block["block_tables"][0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block id 10000 outside"):
        reference.unified_attention(**bad_block)
    short = dict(args, seq_lens=torch.tensor([10], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="query length 20 against seq_lens 10"):
        reference.unified_attention(**short)


def test_an_out_of_another_dtype_is_filled_too(gen):
    """A caller's float32 `out` for bf16 queries: the kernel writes only q's dtype, so those
    rows take the PyTorch path instead of raising."""
    args = make_paged_batch([(20, 40), (1, 9)], 4, 2, 32, 16, torch.bfloat16, gen)
    out = torch.full(args["q"].shape, float("nan"))
    got = reference.unified_attention(**args, out=out)
    assert got is out
    torch.testing.assert_close(got, naive_attention(**args), **TOL[torch.bfloat16])
