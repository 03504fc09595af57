"""Failing examples the property tests found, kept as plain regression tests.

1. Seeded top-p sampling drew by rank in the probability-sorted list. On a flat distribution over
   a large vocabulary, neighbouring ranks are near-tied, and the float32 rounding noise of a forward
   pass in another batch or chunking (~1e-6) swaps them, so the same uniform picked another token
   (engine property, shrunk example below; the sampler now walks the kept tokens in vocabulary
   order).
2. The start-up step-cost profile sent 256-token prompts whatever the engine took: a worker whose
   KV pool caps `max_model_len` below that (``--num-blocks 12``: 192 tokens) failed its start with
   `PromptTooLongError` (found by tests/reliability/test_reliability_memory.py). The profile now
   shortens its prompts to fit, and its requests that do not fit the pool together are preempted.
"""

from __future__ import annotations

import torch

from laneserve.gpu_worker.sampler import Sampler
from laneserve.gpu_worker.sampling_params import SamplingParams
from tests.engine_props.props_helpers import run_engine

PREFIX = [66, 213, 154, 281, 4545, 1227, 493, 768, 10490, 151, 445, 6262, 3, 302, 1343, 645]
PREFIX += [653, 1016, 3, 3229, 7193, 234, 48964]


def test_seeded_top_p_draw_survives_rounding_noise():
    torch.manual_seed(0)
    logits = torch.randn(1, 49152) * 0.3  # flat: the nucleus is thousands of near-tied tokens
    noisy = logits + torch.randn(1, 49152) * 2e-6  # what another batch shape may change
    sampler = Sampler()
    for params in (
        SamplingParams(temperature=0.6, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=3000),
        SamplingParams(temperature=1.0, top_k=500, top_p=0.9),
    ):
        for seed in range(20):
            a, b = (
                sampler(x, [params], [torch.Generator().manual_seed(seed)], [[]], [[]]).token_ids
                for x in (logits, noisy)
            )
            assert a == b, (params, seed)


def test_engine_example_seeded_top_p_beside_chunked_prefills(make_engine):
    """The engine property's shrunk example: five interactive requests on 8-token blocks, a
    4-token budget and 2 seats; r4 (top_p 0.8, seed 516) got another second token than alone."""

    def plain(rid, prompt, **params):
        params = {"temperature": 0.6, "seed": 0, "max_tokens": 1, **params}
        return {
            "request_id": rid,
            "prompt_token_ids": prompt,
            "sampling_params": SamplingParams(**params),
            "lane": "interactive",
        }

    requests = [plain(f"r{i}", [*PREFIX, 3]) for i in range(3)]
    requests.append(plain("r3", PREFIX + [3] * 10))
    requests.append(plain("r4", [*PREFIX, 4089, 16524], top_p=0.8, seed=516, max_tokens=2))
    alone = run_engine(
        make_engine(max_model_len=96, num_blocks=32, enable_prefix_caching=False),
        [requests[4]],
    )["r4"]
    engine = make_engine(
        max_model_len=96,
        block_size=8,
        num_blocks=12,
        max_num_batched_tokens=4,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    mixed = run_engine(engine, requests)["r4"]
    assert mixed.key() == alone.key()
    assert len(alone.token_ids) == 2


def test_step_profile_fits_a_small_kv_pool(make_engine):
    from laneserve.gpu_worker import step_profile

    engine = make_engine(cache=False, num_blocks=12, max_model_len=192, max_num_seqs=16)
    theta, idle_step, steps = step_profile.measure_step_cost_prior(engine)
    assert steps > 0 and idle_step > 0 and len(theta) == step_profile.NUM_FEATURES
    assert engine.scheduler.num_preemptions > 0  # 4 x 256-token prompts cannot share 12 blocks
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
