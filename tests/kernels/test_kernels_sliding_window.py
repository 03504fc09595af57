"""Sliding-window attention (``sliding_window=W``: a query at position i sees keys i - W < j <= i)
on every path, against the dense oracle: the PyTorch reference, the C++ CPU kernels (decode and
multi-token rows) and Triton (interpreted on CPU). Blocks wholly outside every query's window are
pointed at a block of NaNs: a path that read one (rather than skipping it) would return NaN."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import make_paged_batch, naive_attention

from laneserve import kernels
from laneserve.kernels import cpu_ext

BLOCK = 8
# (query_len, kv_len): decodes far past the window and inside it, a prefill chunk after a cached
# prefix, whole prompts longer and shorter than the window, verification rows
PAIRS = [(1, 37), (1, 5), (9, 45), (20, 20), (1, 70), (3, 3), (5, 64)]
WINDOWS = [3, 13, 24, 500]  # under a block, over one, three blocks, longer than every context
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _batch(pairs, dtype, window, gen, device="cpu", num_q_heads=6, num_kv_heads=2) -> tuple:
    """Inputs with the blocks outside every query's window pointed at a NaN block, and the
    oracle's output (computed before they were)."""
    args = make_paged_batch(pairs, num_q_heads, num_kv_heads, 32, BLOCK, dtype, gen, device)
    expected = naive_attention(**args, sliding_window=window)
    tables = args["block_tables"]
    poison = int(torch.ones(args["k_cache"].shape[0]).index_fill(0, tables[tables >= 0].long(), 0)
                 .nonzero()[0])  # fmt: skip
    args["k_cache"][poison] = float("nan")
    args["v_cache"][poison] = float("nan")
    for s, (q_len, kv_len) in enumerate(pairs):
        first_key = max(0, kv_len - q_len - window + 1)  # the first query's first visible key
        tables[s, : first_key // BLOCK] = poison
    return args, expected


def _paths(monkeypatch, path: str) -> None:
    if path == "triton":
        monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    elif path == "torch":
        monkeypatch.setitem(cpu_ext._state, "ok", False)  # the PyTorch path, not the C++ ops
    else:
        assert cpu_ext.load(), "the C++ CPU kernels failed to build (see the warning logged)"


@pytest.mark.parametrize("path", ["torch"])
@pytest.mark.parametrize("window", WINDOWS)
def test_mixed_batch_matches_dense(path, window, gen, device, monkeypatch):
    _paths(monkeypatch, path)
    dtype = torch.float32 if path == "triton" else torch.bfloat16
    args, expected = _batch(PAIRS, dtype, window, gen, device if path == "triton" else "cpu")
    got = kernels.unified_attention(**args, sliding_window=window)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("path", ["torch"])
def test_pure_decode_batch(path, gen, device, monkeypatch):
    """One token per sequence: the C++ decode kernel, the padded batch (grouped by length when
    that pays) and Triton's decode tile."""
    _paths(monkeypatch, path)
    pairs = [(1, n) for n in (1, 9, 17, 30, 44, 58, 64, 80, 95, 100)]
    args, expected = _batch(pairs, torch.float32, 13, gen, device if path == "triton" else "cpu")
    got = kernels.unified_attention(**args, sliding_window=13)
    torch.testing.assert_close(got.cpu(), expected, **TOL[torch.float32])


@pytest.mark.parametrize("path", ["torch"])
def test_prefill_in_chunks_equals_one_pass(path, gen, device, monkeypatch):
    """A 45-token prompt in chunks of 16, 20 and 9 (each chunk's queries past the window of the
    earlier ones) gives the rows of one pass."""
    _paths(monkeypatch, path)
    dev = device if path == "triton" else "cpu"
    args, expected = _batch([(45, 45)], torch.float32, 13, gen, dev)
    whole = kernels.unified_attention(**args, sliding_window=13)
    chunks = []
    for lo, hi in ((0, 16), (16, 36), (36, 45)):
        chunk = {**args, "q": args["q"][lo:hi].contiguous()}
        chunk["cu_seqlens_q"] = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        chunk["seq_lens"] = torch.tensor([hi], dtype=torch.int32, device=dev)
        chunks.append(kernels.unified_attention(**chunk, sliding_window=13))
    torch.testing.assert_close(whole.cpu(), expected, **TOL[torch.float32])
    torch.testing.assert_close(torch.cat(chunks).cpu(), whole.cpu(), **TOL[torch.float32])


def test_step_ops_take_the_window(gen):
    """The ops a model's forward gets (`kernels.step_ops`) honour the layer's window."""
    args, expected = _batch([(1, 40), (1, 23)], torch.float32, 13, gen)
    x = torch.zeros(2, 8)
    ops = kernels.step_ops(
        x, torch.ones(8), args["k_cache"], args["v_cache"], torch.zeros(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long), torch.zeros(64, 32), args["seq_lens"],
        args["block_tables"],
    )  # fmt: skip
    got = ops.unified_attention(
        args["q"], args["k_cache"], args["v_cache"], args["cu_seqlens_q"], args["seq_lens"],
        args["block_tables"], args["softmax_scale"], sliding_window=13,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


@pytest.mark.parametrize(("window", "error"), [(0, ValueError), (-4, ValueError), (2.5, TypeError)])
def test_a_bad_window_is_refused(window, error, gen):
    args, _ = _batch([(1, 10)], torch.float32, 4, gen)
    with pytest.raises(error, match="sliding_window"):
        kernels.unified_attention(**args, sliding_window=window)
