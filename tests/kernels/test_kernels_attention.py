"""unified_attention: Triton (interpreted on CPU) and the PyTorch reference against a dense oracle."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_attention

from laneserve import kernels
from laneserve.kernels import reference
from laneserve.kernels.triton import unified_attention as triton_attention

MIXED = [(1, 37), (7, 7), (20, 45), (1, 200), (13, 13)]


def _tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (4, 4, 32, 16, torch.float32),  # MHA
        (6, 2, 64, 8, torch.bfloat16),  # GQA 3, a group that is not a power of two
        (8, 1, 32, 32, torch.bfloat16),  # GQA 8 (MQA)
        (8, 1, 64, 8, torch.float32),
    ],
)
def test_mixed_batch_matches_reference_and_dense(
    num_q_heads, num_kv_heads, head_dim, block_size, dtype, gen, device
):
    args = make_paged_batch(
        MIXED, num_q_heads, num_kv_heads, head_dim, block_size, dtype, gen, device
    )
    expected = naive_attention(**args)

    ref = reference.unified_attention(
        **{k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}
    )
    tri = triton_attention(**args)

    assert ref.dtype == tri.dtype == dtype
    assert ref.shape == tri.shape == args["q"].shape
    torch.testing.assert_close(ref.float(), expected, **_tolerance(dtype))
    torch.testing.assert_close(tri.float().cpu(), expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pure_decode_batch(dtype, gen, device):
    """All query lengths 1: the reference's padded fast path and the Triton decode tile."""
    pairs = [(1, 1), (1, 17), (1, 64), (1, 100)]
    args = make_paged_batch(pairs, 8, 2, 32, 16, dtype, gen, device)
    expected = naive_attention(**args)
    cpu_args = {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}
    torch.testing.assert_close(
        reference.unified_attention(**cpu_args).float(), expected, **_tolerance(dtype)
    )
    torch.testing.assert_close(
        triton_attention(**args).float().cpu(), expected, **_tolerance(dtype)
    )


def test_block_ids_near_end_of_large_pool(gen, device):
    """Block ids close to num_blocks - 1 of a large pool (index arithmetic must not overflow/clip)."""
    pairs = [(1, 40), (9, 30)]
    args = make_paged_batch(
        pairs, 4, 2, 32, 8, torch.float32, gen, device, num_blocks=40_000, use_last_blocks=True
    )
    assert int(args["block_tables"].max()) == 40_000 - 1
    expected = naive_attention(**args)
    torch.testing.assert_close(triton_attention(**args).cpu(), expected, atol=1e-5, rtol=1e-5)
    cpu_args = {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}
    torch.testing.assert_close(
        reference.unified_attention(**cpu_args), expected, atol=1e-5, rtol=1e-5
    )


def test_chunked_prefill_equals_whole_prefill(gen, device):
    """Causal offset: a prompt computed as two chunks gives the same rows as in one pass."""
    args = make_paged_batch([(30, 30)], 4, 2, 32, 16, torch.float32, gen, device)
    whole = reference.unified_attention(**args)
    cu = torch.tensor([0, 12], dtype=torch.int32, device=device)
    second = dict(args, q=args["q"][18:], cu_seqlens_q=cu)
    torch.testing.assert_close(triton_attention(**second), whole[18:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        reference.unified_attention(**second), whole[18:], atol=1e-6, rtol=1e-6
    )


def test_out_is_written_in_place_and_empty_sequences_are_skipped(gen, device):
    args = make_paged_batch([(2, 10), (0, 5), (1, 9)], 4, 4, 32, 8, torch.float32, gen, device)
    expected = naive_attention(**args)
    for fn in (triton_attention, kernels.unified_attention):
        out = torch.full_like(args["q"], float("nan"))
        result = fn(**args, out=out)
        assert result is out
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_dispatch_forced_triton_matches_torch(gen, monkeypatch, device):
    args = make_paged_batch(MIXED[:3], 4, 2, 32, 16, torch.float32, gen, device)
    monkeypatch.setenv("LANESERVE_ATTENTION_BACKEND", "torch")
    assert kernels.backend_for(args["q"]) == "torch"
    via_torch = kernels.unified_attention(**args)
    monkeypatch.setenv("LANESERVE_ATTENTION_BACKEND", "triton")
    assert kernels.backend_for(args["q"]) == "triton"
    via_triton = kernels.unified_attention(**args)
    torch.testing.assert_close(via_triton, via_torch, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("LANESERVE_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LANESERVE_ATTENTION_BACKEND"):
        kernels.unified_attention(**args)


def test_bad_attention_arguments_raise_named_errors(gen, device):
    """Every tensor on the test's device: on a GPU without TRITON_INTERPRET the Triton wrapper
    refuses CPU tensors before it looks at their layout."""
    args = make_paged_batch([(2, 9)], 4, 2, 32, 8, torch.float32, gen, device)
    dev = args["q"].device
    cases = [
        (dict(cu_seqlens_q=args["cu_seqlens_q"].float()), TypeError, "cu_seqlens_q"),
        (dict(q=args["q"][:, :3]), ValueError, "multiple of num_kv_heads"),
        (dict(q=args["q"][..., :16]), ValueError, "head_dim"),
        (
            dict(seq_lens=torch.tensor([9, 9], dtype=torch.int32, device=dev)),
            ValueError,
            "cu_seqlens_q",
        ),
        (dict(v_cache=args["v_cache"].half()), TypeError, "v_cache"),
        (dict(out=torch.empty(2, 4, 16, device=dev)), ValueError, "out"),
        (dict(q=args["q"].unsqueeze(0)), ValueError, "q must have 3 dimensions"),
    ]
    for override, error, message in cases:
        with pytest.raises(error, match=message):
            kernels.unified_attention(**{**args, **override})
    # layout errors come from the Triton wrapper (the reference copes with any strides)
    with pytest.raises(TypeError, match="k_cache dtype"):
        triton_attention(**{**args, "q": args["q"].bfloat16()})
    strided_q = torch.randn(2, 4, 64, device=dev)[..., ::2]
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        triton_attention(**{**args, "q": strided_q})


@pytest.mark.parametrize(
    ("pairs", "num_q_heads", "num_kv_heads", "head_dim", "dtype", "num_segments"),
    [
        ([(1, 1), (1, 17), (1, 100), (1, 300)], 8, 2, 64, torch.float32, 4),  # decode, GQA 4
        ([(1, 3), (1, 129)], 4, 4, 128, torch.bfloat16, 16),  # more segments than tiles
        (MIXED, 6, 2, 64, torch.float32, 2),  # prefill chunks through the split path too
    ],
)
def test_split_kv_matches_one_pass(
    pairs, num_q_heads, num_kv_heads, head_dim, dtype, num_segments, gen, device
):
    """Split-KV (segments + reduce) gives the one-pass kernel's rows, including sequences whose
    context is shorter than the segment count (empty segments) and GQA groups."""
    args = make_paged_batch(pairs, num_q_heads, num_kv_heads, head_dim, 16, dtype, gen, device)
    expected = naive_attention(**args)
    one_pass = triton_attention(**args, num_segments=1)
    split = triton_attention(**args, num_segments=num_segments)
    torch.testing.assert_close(split.float().cpu(), expected, **_tolerance(dtype))
    torch.testing.assert_close(split.float(), one_pass.float(), **_tolerance(dtype))


def test_split_kv_large_pool_and_in_place_output(gen, device):
    args = make_paged_batch(
        [(1, 70), (1, 33)],
        4,
        2,
        32,
        8,
        torch.float32,
        gen,
        device,
        num_blocks=40_000,
        use_last_blocks=True,
    )
    out = torch.full_like(args["q"], float("nan"))
    result = triton_attention(**args, out=out, num_segments=8)
    assert result is out
    torch.testing.assert_close(out.cpu(), naive_attention(**args), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_segments"):
        triton_attention(**args, num_segments=3)


def test_split_kv_is_chosen_only_for_small_decode_grids():
    from laneserve.kernels.triton.attention import SPLIT_KV_SEGMENTS, choose_num_segments

    cpu = torch.device("cpu")
    assert choose_num_segments(cpu, 1, 8, 1) == 1  # no SMs to fill on the CPU interpreter
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        sms = torch.cuda.get_device_properties(gpu).multi_processor_count
        assert choose_num_segments(gpu, 1, 8, 1) == SPLIT_KV_SEGMENTS
        assert choose_num_segments(gpu, sms, 8, 1) == 1  # the grid already fills the GPU
        assert choose_num_segments(gpu, 1, 8, None) == 1  # prefill chunks: one pass
