"""Per-request isolation after the forward pass, and admission checks against the tokenizer.

Tiny random Llama whose vocabulary is wider than its tokenizer (as Qwen2's 151,936 rows vs its
~151.6k-token tokenizer). Faults are injected into one request's own parts (its detokenizer, its
parameters); the rest of the engine is real."""

from __future__ import annotations

import inspect

import pytest

from laneserve.gpu_worker import LLM
from laneserve.gpu_worker.errors import InvalidRequestError
from laneserve.gpu_worker.sampling_params import SamplingParams
from tests.engine_props.props_helpers import PADDED_VOCAB, TOKENIZER_LEN, run_engine

PROMPT = [17, 2000, 345, 9000, 12, 77, 40000, 5]


def req(rid: str, **params) -> dict:
    params.setdefault("max_tokens", 6)
    params.setdefault("ignore_eos", True)
    return {
        "request_id": rid,
        "prompt_token_ids": PROMPT + [len(rid)],
        "sampling_params": SamplingParams(**params),
    }


def bystanders() -> list[dict]:
    return [
        req("greedy", temperature=0.0),
        req("seeded", temperature=1.0, seed=11),
        req("seeded_top_p", temperature=0.8, top_p=0.9, seed=5),
    ]


@pytest.fixture(scope="module")
def alone(make_engine):
    engine = make_engine()
    return {r["request_id"]: run_engine(engine, [r])[r["request_id"]].key() for r in bystanders()}


@pytest.mark.parametrize("bad", [TOKENIZER_LEN, PADDED_VOCAB - 1, PADDED_VOCAB, -1, 3.0, True])
def test_prompt_ids_beyond_the_tokenizer_are_rejected_at_admission(make_engine, bad):
    engine = make_engine()
    assert engine.model_config.vocab_size == PADDED_VOCAB
    with pytest.raises(InvalidRequestError, match=rf"\[0, {TOKENIZER_LEN}\)"):
        engine.add_request("bad", prompt_token_ids=[5, bad, 7])
    assert not engine.has_unfinished_requests()
    ok = run_engine(engine, [req("ok", max_tokens=2) | {"prompt_token_ids": [TOKENIZER_LEN - 1]}])
    assert ok["ok"].finish_reason == "length"


def test_output_processing_error_ends_only_that_request(make_engine, alone):
    """The victim's detokenizer raises on its 3rd token: it ends with finish_reason "error"
    (the broker reports engine_error) after its first 2 tokens; the others finish with the
    tokens they get alone."""
    calls = 0

    def break_detokenizer(engine):
        state = engine.states["victim"]
        original = state.detokenizer.update

        def failing_update(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("detokenizer exploded")
            return original(*args, **kwargs)

        state.detokenizer.update = failing_update

    requests = [*bystanders(), req("victim", temperature=0.0)]
    results = run_engine(make_engine(), requests, after_add=break_detokenizer)
    victim = results["victim"]
    assert victim.finish_reason == "error"
    assert "output processing failed" in victim.error and "detokenizer exploded" in victim.error
    assert len(victim.token_ids) == 2
    for rid, key in alone.items():
        assert results[rid].key() == key, rid


def test_one_row_failing_in_the_sampler_leaves_the_others_their_tokens(make_engine, alone):
    """A row the sampler cannot serve (logprobs past the vocabulary: topk raises) fails alone;
    the seeded rows beside it draw from their restored generators, so their tokens are the
    ones they get alone."""

    def break_params(engine):
        engine.states["victim"].params.logprobs = PADDED_VOCAB + 1  # past validation

    requests = [*bystanders(), req("victim", temperature=0.7, seed=1)]
    results = run_engine(make_engine(), requests, after_add=break_params)
    assert results["victim"].finish_reason == "error"
    assert "sampling failed" in results["victim"].error
    assert results["victim"].token_ids == []
    for rid, key in alone.items():
        assert results[rid].key() == key, rid


def test_sampled_ids_beyond_the_tokenizer_decode_to_empty_text(make_engine):
    """The model may sample a padding row the tokenizer does not know: no text, no error."""
    from laneserve.gpu_worker.detokenizer import IncrementalDetokenizer

    tokenizer = make_engine().tokenizer
    ids = tokenizer.encode(" hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [TOKENIZER_LEN + 3, *PROMPT], SamplingParams())
    deltas = [detok.update([i]).delta_text for i in [ids[0], TOKENIZER_LEN + 7, *ids[1:]]]
    assert "".join(deltas) + detok.flush() == " hello world"


def test_llm_dtype_defaults_to_auto():
    assert inspect.signature(LLM).parameters["dtype"].default == "auto"
