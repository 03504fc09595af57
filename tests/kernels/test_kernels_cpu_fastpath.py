"""The CPU reference's fast paths: length-grouped decode, per-step memos, flat-slot cache writes."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_attention

from laneserve.kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_length_grouped_decode_matches_dense(dtype, gen):
    # 16 decodes, contexts 3..390: padding everything to 390 would waste > 20 %, so they are grouped
    lens = [3, 390, 17, 250, 64, 5, 301, 128, 33, 377, 9, 200, 150, 16, 80, 260]
    assert reference._decode_groups(lens) is not None
    args = make_paged_batch([(1, n) for n in lens], 6, 2, 32, 16, dtype, gen)
    expected = naive_attention(**args)
    got = reference.unified_attention(**args)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got.float(), expected, **tol)


def test_decode_groups_only_when_padding_is_wasteful():
    assert reference._decode_groups([100] * 16) is None  # equal lengths: one padded call
    assert reference._decode_groups([100, 1000]) is None  # too few rows to split
    lens = [1000, 10, 10, 1000] + [10] * 10 + [1000] * 2
    groups = reference._decode_groups(lens)
    assert groups is not None
    assert sorted(i for g in groups for i in g) == list(range(16))  # every row exactly once
    flat = [lens[i] for g in groups for i in g]
    assert flat == sorted(flat)  # ascending length, so each group pads to a close maximum


def test_rope_memo_never_returns_rows_for_stale_positions(gen):
    cache = torch.randn(64, 16, generator=gen)
    positions = torch.tensor([3, 9, 20])

    def rotated(pos):
        q = torch.ones(3, 2, 16)
        k = torch.ones(3, 1, 16)
        reference.rotary_embedding(pos, q, k, cache)
        return q

    first = rotated(positions)
    assert torch.equal(rotated(positions), first)  # memo hit: same rows
    positions.add_(1)  # refilled in place, like a CUDA-graph static input
    fresh = rotated(positions.clone())
    assert torch.equal(rotated(positions), fresh)
    assert not torch.equal(fresh, first)


def test_cache_write_contiguous_and_strided_agree(gen):
    key = torch.randn(5, 2, 8, generator=gen)
    value = torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([0, 17, 18, -1, 63])
    flat = torch.zeros(2, 4, 16, 2, 8)  # [2, blocks, block_size, Hk, D] like the model runner's
    reference.reshape_and_cache(key, value, flat[0], flat[1], slots)
    strided = torch.zeros(4, 2, 16, 8).transpose(1, 2)  # same shape, not contiguous
    strided_v = torch.zeros(4, 2, 16, 8).transpose(1, 2)
    reference.reshape_and_cache(key, value, strided, strided_v, slots)
    assert torch.equal(flat[0], strided) and torch.equal(flat[1], strided_v)
    keep = [0, 1, 2, 4]
    assert torch.equal(flat[0].reshape(-1, 2, 8)[slots[keep]], key[keep])
    assert int((flat[0] != 0).any(-1).any(-1).sum()) == 4  # the padded row wrote nothing


def test_memoized_ops_accept_inference_mode_tensors(gen):
    """Inference tensors carry no version counter: the memo must compute instead of failing."""
    lens = [3, 390, 17, 250, 64, 5, 301, 128, 33, 377, 9, 200, 150, 16, 80, 260]
    args = make_paged_batch([(1, n) for n in lens], 6, 2, 32, 16, torch.float32, gen)
    expected = naive_attention(**args)
    cache = torch.randn(64, 16, generator=gen)
    q_ref = torch.ones(3, 2, 16)
    reference.rotary_embedding(torch.tensor([3, 9, 20]), q_ref, torch.ones(3, 1, 16), cache)
    with torch.inference_mode():
        inf = {k: v.clone() if torch.is_tensor(v) else v for k, v in args.items()}
        assert inf["seq_lens"].is_inference()
        got = reference.unified_attention(**inf)
        q = torch.ones(3, 2, 16)
        reference.rotary_embedding(torch.tensor([3, 9, 20]), q, torch.ones(3, 1, 16), cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(q, q_ref)
