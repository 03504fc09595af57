"""Engine-level properties on a tiny random Llama in float32 (exactness mode).

A random workload (prompts sharing random prefixes, greedy and seeded sampling with top-k/top-p,
stop strings, max_tokens, lanes, priorities) runs on an engine with a random block size
(8/16/32), chunk budget, seat count, KV pool (small pools preempt on their own) and prefix caching
on or off, with forced preemptions at random steps. Each request's output (tokens, text, finish
reason) must equal its output alone on a reference engine; `max_tokens` and stop strings hold;
the joined streaming deltas are the decode of the tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from laneserve.gpu_worker.sampling_params import SamplingParams
from tests.engine_props.props_helpers import TOKENIZER_LEN, prop_settings, run_engine

MAX_MODEL_LEN = 96
REPLACEMENT = "\ufffd"

token_ids = st.integers(3, TOKENIZER_LEN - 1)  # no BOS/EOS in prompts


@st.composite
def sampling(draw) -> SamplingParams:
    greedy = draw(st.booleans())
    return SamplingParams(
        max_tokens=draw(st.integers(1, 8)),
        temperature=0.0 if greedy else draw(st.sampled_from([0.6, 1.0, 1.4])),
        top_k=0 if greedy else draw(st.sampled_from([0, 20])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.8])),
        seed=None if greedy else draw(st.integers(0, 2**31)),
        stop=draw(st.sampled_from([[], [], ["a"], ["e", " th"]])),
        ignore_eos=draw(st.booleans()),
    )


@st.composite
def workloads(draw):
    prefixes = draw(st.lists(st.lists(token_ids, min_size=16, max_size=40), min_size=1, max_size=2))
    requests = []
    for i in range(draw(st.integers(1, 5))):
        prompt = draw(st.sampled_from(prefixes)) + draw(
            st.lists(token_ids, min_size=1, max_size=20)
        )
        requests.append(
            {
                "request_id": f"r{i}",
                "prompt_token_ids": prompt,
                "sampling_params": draw(sampling()),
                "lane": draw(st.sampled_from(["interactive", "batch"])),
                "priority": draw(st.integers(0, 2)),
            }
        )
    block_size = draw(st.sampled_from([8, 16, 32]))
    config = {
        "block_size": block_size,
        "num_blocks": MAX_MODEL_LEN // block_size * draw(st.sampled_from([1, 2, 6])),
        "max_num_batched_tokens": draw(st.sampled_from([4, 7, 16, 33, 128])),
        "max_num_seqs": draw(st.sampled_from([2, 8])),
        "enable_prefix_caching": draw(st.sampled_from([True, True, False])),
        "long_prefill_token_threshold": draw(st.sampled_from([None, 5])),
    }
    preempt_at: dict[int, list[str]] = {}
    for step, idx in draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 4)), max_size=6)):
        preempt_at.setdefault(step, []).append(f"r{idx % len(requests)}")
    gap = draw(st.sampled_from([0, 3, 8]))  # arrivals in waves let later prompts hit the cache
    arrive_at = {r["request_id"]: i * gap + draw(st.integers(0, 2)) for i, r in enumerate(requests)}
    return requests, config, preempt_at, arrive_at


def copy_request(r: dict) -> dict:
    return {**r, "sampling_params": SamplingParams.from_dict(r["sampling_params"].to_dict())}


@pytest.fixture(scope="module")
def reference(make_engine):
    """Each request alone on a default engine (prefix cache off), memoised per request."""
    engine = make_engine(max_model_len=MAX_MODEL_LEN, num_blocks=32, enable_prefix_caching=False)
    memo: dict[str, object] = {}

    def alone(r: dict):
        key = repr((r["prompt_token_ids"], r["sampling_params"].to_dict()))
        if key not in memo:
            memo[key] = run_engine(engine, [copy_request(r)])[r["request_id"]]
        return memo[key]

    return alone


def expected_text(tokenizer, prompt: list[int], output: list[int]) -> str | None:
    """Full decode of the output after the prompt, or None when a byte-level character spans
    the prompt's end (the text then depends on how the window is cut)."""

    def decode(ids):
        ids = [i for i in ids if i < TOKENIZER_LEN]
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    head = decode(prompt)
    if head.endswith(REPLACEMENT):
        return None
    full = decode(prompt + output)
    return full[len(head) :] if full.startswith(head) else None


@prop_settings(15)
@given(workloads())
def test_outputs_are_independent_of_batching_caching_and_preemption(
    make_engine, reference, workload
):
    requests, config, preempt_at, arrive_at = workload
    engine = make_engine(cache=False, max_model_len=MAX_MODEL_LEN, **config)
    results = run_engine(
        engine, [copy_request(r) for r in requests], preempt_at=preempt_at, arrive_at=arrive_at
    )
    preemptions = sum(res.metrics["preemptions"] for res in results.values())
    event(f"preempted: {preemptions > 0}")
    event(f"prefix hits: {engine.block_manager.prefix_cache_hits > 0}")
    for r in requests:
        rid, params = r["request_id"], r["sampling_params"]
        got, alone = results[rid], reference(r)
        assert got.key() == alone.key(), f"{rid} differs from its run alone"
        n = len(got.token_ids)
        assert 1 <= n <= params.max_tokens
        if got.finish_reason == "length":
            assert n == params.max_tokens or len(r["prompt_token_ids"]) + n == MAX_MODEL_LEN
        for stop in params.stop:
            assert stop not in got.text, f"{rid}: stop string {stop!r} in the output"
        full = expected_text(engine.tokenizer, r["prompt_token_ids"], got.token_ids)
        if full is None:
            continue
        if not params.stop:
            assert got.text == full
        else:
            assert full.startswith(got.text)
            if got.finish_reason == "stop" and got.token_ids[-1] not in engine.eos_token_ids:
                assert any(full[len(got.text) :].startswith(s) for s in params.stop)
    engine.check_integrity()
