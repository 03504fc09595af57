"""Greedy output is the same whatever the batching, chunking, caching, preemption or block size
(float32, bundled SmolLM2). Each test compares against every prompt run alone."""

from __future__ import annotations

import pytest

from laneserve.gpu_worker import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDS = [
    "The history of the printing press",
    "Photosynthesis converts light energy into",
    "In 1969, the first humans",
    "A good recipe for bread needs flour, water,",
    "def quicksort(xs):",
    "The mitochondria is",
    "Translate to French: The cat sleeps on the sofa.",
    "Summarize: Rivers carry sediment from mountains to the sea, shaping valleys and deltas.",
]


def mixed_prompts(tokenizer, n: int = 16) -> list[list[int]]:
    """n prompts of varied lengths (3 .. ~110 tokens), as token ids."""
    text = " ".join(SEEDS) * 4
    ids = tokenizer(text)["input_ids"]
    lengths = [3, 7, 15, 16, 17, 31, 32, 33, 48, 64, 70, 5, 90, 11, 100, 111][:n]
    return [ids[i * 3 : i * 3 + n_tok] for i, n_tok in enumerate(lengths)]


@pytest.fixture(scope="module")
def prompts(base_llm):
    return mixed_prompts(base_llm.tokenizer)


@pytest.fixture(scope="module")
def alone(base_llm, prompts):
    """Reference: each prompt on its own, prefix cache off (fresh computation every time)."""
    return [base_llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_batch_of_16_equals_alone(base_llm, prompts, alone):
    outs = base_llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)


@pytest.mark.parametrize("budget", [7, 64, 512])
def test_chunked_prefill_budgets(make_llm, prompts, alone, budget):
    """Chunks smaller than a block, a whole number of blocks, and one step's split of the batch.
    A budget past the batch's 653 prompt tokens (4096) is the default budget's single step,
    test_batch_of_16_equals_alone; one of a block (16) is test_long_prefill_threshold's chunk."""
    llm = make_llm(max_num_batched_tokens=budget, max_num_seqs=8, enable_prefix_caching=False)
    # 64 = 4 * 16 = one of the prompt lengths: a chunk size that divides the prompt exactly
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert max(o.metrics["prefill_chunks"] for o in outs) >= (2 if budget <= 64 else 1)
    llm.check_integrity()


def test_long_prefill_threshold(make_llm, prompts, alone):
    llm = make_llm(long_prefill_token_threshold=16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert max(o.metrics["prefill_chunks"] for o in outs) >= 7  # 111 tokens / 16
    llm.check_integrity()


def test_prefix_cache_off_on_repeated(make_llm, base_llm, alone, prompts):
    preamble = base_llm.tokenizer(" ".join(SEEDS))["input_ids"][:70]  # > 4 blocks of 16
    shared = [preamble + p[:9] for p in prompts[:6]]
    expect = [base_llm.generate([p], GREEDY)[0].token_ids for p in shared]
    off = make_llm(enable_prefix_caching=False).generate(shared, GREEDY)
    assert [o.token_ids for o in off] == expect
    assert all(o.num_cached_tokens == 0 for o in off)
    on_llm = make_llm(enable_prefix_caching=True)
    first = on_llm.generate(shared, GREEDY)
    again = on_llm.generate(shared, GREEDY)
    assert [o.token_ids for o in first] == expect
    assert [o.token_ids for o in again] == expect
    assert all(o.num_cached_tokens >= 64 for o in again)  # the multi-block preamble hit
    assert all(
        o.num_cached_tokens % 16 == 0 and o.num_cached_tokens < len(p)
        for o, p in zip(again, shared, strict=True)
    )
    stats = on_llm.stats()
    assert (
        stats["prefix_cache_hits"] > 0
        and stats["prefix_cache_queries"] > stats["prefix_cache_hits"]
    )
    on_llm.check_integrity()


def test_small_kv_pool_forces_preemption(make_llm, prompts, alone):
    # 14 blocks x 16 = 224 slots for 16 requests of up to 121 tokens: must preempt to finish
    llm = make_llm(num_blocks=14, max_model_len=224, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert llm.stats()["num_preemptions"] > 0
    assert sum(o.metrics["preemptions"] for o in outs) == llm.stats()["num_preemptions"]
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    llm.check_integrity()


def test_block_size_8_equals_16(make_llm, prompts, alone):
    llm = make_llm(block_size=8)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == alone
    llm.check_integrity()


def test_identical_prompts_in_one_step_share_the_prefill(make_llm, prompts, alone):
    """n > 1 / siblings: the copies admitted in the same step as the first hit its prompt blocks
    (registered at allocation) and still produce exactly the tokens of the prompt run alone."""
    llm = make_llm(enable_prefix_caching=True)
    p, expect = prompts[14], alone[14]  # 100 tokens: 6 full blocks of 16
    outs = llm.generate([p, p, p], GREEDY)
    assert [o.token_ids for o in outs] == [expect] * 3
    assert [o.num_cached_tokens for o in outs] == [0, 96, 96]
    llm.check_integrity()
