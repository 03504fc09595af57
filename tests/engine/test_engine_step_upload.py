"""StepUploader: the packed one-copy upload (what CUDA uses) gives the same tensors and tokens."""

from __future__ import annotations

import numpy as np
import torch

from laneserve.gpu_worker import SamplingParams
from laneserve.gpu_worker.step_upload import StepUploader


def _arrays(rng: np.random.Generator, num_reqs: int, tokens: int) -> list[np.ndarray]:
    return [
        rng.integers(0, 50_000, tokens, dtype=np.int64),  # input ids
        rng.integers(0, 4096, tokens, dtype=np.int64),  # positions
        rng.integers(-1, 10**9, tokens, dtype=np.int64),  # slot mapping
        np.arange(num_reqs + 1, dtype=np.int32) * 3,  # cu_seqlens_q (odd length: 4-byte dtype)
        rng.integers(1, 4096, num_reqs, dtype=np.int32),  # seq lens
        rng.integers(0, 40_000, (num_reqs, 7), dtype=np.int32),  # block tables
        np.zeros(0, dtype=np.int64),  # no request samples this step
    ]


def test_packed_upload_equals_each_array_across_reused_buffers():
    rng = np.random.default_rng(0)
    packed = StepUploader(torch.device("cpu"), pack=True)
    kept = []
    for num_reqs, tokens in [(3, 9), (1, 1), (17, 300), (2, 5), (5, 2)]:  # grows, then reuses
        arrays = _arrays(rng, num_reqs, tokens)
        tensors = packed.upload(arrays)
        kept.append((arrays, tensors))
        for a, t in zip(arrays, tensors, strict=True):
            assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
            np.testing.assert_array_equal(t.numpy(), a)
    # earlier steps' tensors are not overwritten when the host buffers are reused
    for arrays, tensors in kept:
        for a, t in zip(arrays, tensors, strict=True):
            np.testing.assert_array_equal(t.numpy(), a)
    assert packed.uploads == 5


def test_engine_tokens_equal_with_the_packed_upload(make_llm):
    llm = make_llm()
    prompts = ["The capital of France is", "def add(a, b):", "Water boils at"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    runner.uploader = StepUploader(runner.device, pack=True)
    packed = [o.token_ids for o in llm.generate(prompts, params)]
    assert packed == plain
    assert runner.uploader.uploads >= 12  # one upload per step went through the packed path
    llm.engine.check_integrity()


def test_profile_forward_runs_and_leaves_the_kv_cache_alone(make_llm):
    """The KV-sizing profile run (CUDA: peak bytes) works on this device and writes no KV slot."""
    from laneserve.gpu_worker.kv_pool import profile_activation_bytes

    llm = make_llm()
    runner = llm.engine.runner
    before = [t.clone() for t in runner.kv_caches[:2]]
    peak = profile_activation_bytes(runner.model, 96, 8, runner.block_size)
    assert (peak is None) == (runner.device.type != "cuda")
    if peak is not None:
        assert peak > 0
    for t, b in zip(runner.kv_caches[:2], before, strict=False):
        assert torch.equal(t, b)
