"""Offline API contracts: bad input, stop handling, EOS, aborts, chat template, seeds, logprobs."""

from __future__ import annotations

import pytest

from laneserve.gpu_worker import SamplingParams
from laneserve.gpu_worker.errors import InvalidRequestError, PromptTooLongError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(max_model_len=256, num_blocks=64)


def test_bad_input_raises_and_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(PromptTooLongError, match="at most 255 prompt tokens") as err:
        llm.generate([[5] * 256], GREEDY)
    assert err.value.prompt_tokens == 256 and err.value.max_model_len == 256
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([[10**9]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # nothing half-submitted: a good prompt after all that still works
    out = llm.generate(["Hello"], GREEDY)[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_prompt_plus_max_tokens_over_limit_finishes_with_length(llm):
    prompt = [100 + i for i in range(250)]
    out = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 256


def test_eos_is_in_token_ids_not_in_text(llm):
    msgs = [{"role": "user", "content": "Say just the word yes."}]
    out = llm.chat([msgs], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_chat_prompt_ids_equal_chat_template(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = llm.chat([msgs], GREEDY)[0]
    expect = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.tokenizer(expect, add_special_tokens=False)["input_ids"]


def test_count_to_ten_stops_before_7(llm):
    msgs = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.chat([msgs], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert "7" in full.text, full.text
    cut = llm.chat([msgs], SamplingParams(max_tokens=40, temperature=0.0, stop=["7"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("7")]
    kept = llm.chat(
        [msgs],
        SamplingParams(max_tokens=40, temperature=0.0, stop=["7"], include_stop_str_in_output=True),
    )[0]
    assert kept.text == full.text[: full.text.index("7") + 1]


def test_stop_string_inside_a_longer_token(llm):
    """A stop string equal to the first characters of a multi-character token cuts right before it."""
    base = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0)
    )[0]
    tok = llm.tokenizer
    pieces = [tok.decode([t]) for t in base.token_ids]
    idx = next(i for i, p in enumerate(pieces) if len(p.strip()) >= 3)
    stop = pieces[idx][:2]
    prefix = "".join(pieces[:idx])
    if stop in prefix:
        pytest.skip("the stop string occurs earlier in this output")
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index(stop)]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    total = engine.stats()["num_total_blocks"]
    engine.add_request(
        "a1",
        engine.prompts.encode("Tell me a long story about dragons."),
        sampling_params=SamplingParams(max_tokens=200, ignore_eos=True),
    )
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_free_blocks"] < total
    engine.abort_request("a1")
    deltas = engine.step()
    assert [d.finish_reason for d in deltas if d.request_id == "a1"] == ["abort"]
    assert engine.stats()["num_free_blocks"] == total
    assert not engine.has_unfinished_requests()


def test_seeded_sampling_reproducible_and_metrics(llm):
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234, logprobs=2)
    a = llm.generate(["Once upon a time"], sp)[0]
    b = llm.generate(["Once upon a time", "Another prompt in the batch"], [sp, GREEDY])[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(a.token_ids)
    assert all(
        e["token_id"] == t and len(e["top"]) == 2
        for e, t in zip(a.logprobs, a.token_ids, strict=True)
    )
    # token texts come from the engine (contracts.engine_io.label_logprobs), special tokens kept
    decode = llm.tokenizer.decode
    assert [e["token"] for e in a.logprobs] == [decode([t]) for t in a.token_ids]
    assert all(e["top_tokens"] == [decode([i]) for i, _ in e["top"]] for e in a.logprobs)
    m = a.metrics
    assert m["completion_tokens"] == len(a.token_ids)
    assert m["prompt_tokens"] == len(a.prompt_token_ids)
    assert m["queue_ms"] >= 0 and m["prefill_ms"] > 0 and m["decode_ms"] > 0
    assert m["tpot_ms"] == pytest.approx(m["decode_ms"] / (len(a.token_ids) - 1))


def test_interactive_lane_runs(llm):
    out = llm.generate(["Hi"], GREEDY, lane="interactive")[0]
    assert out.token_ids
    with pytest.raises(InvalidRequestError, match="lane"):
        llm.generate(["Hi"], GREEDY, lane="vip")


def test_token_counters_count_prompt_positions_computed_and_tokens_generated(llm):
    """`num_prefill_tokens` counts the prompt positions the engine computed (prefix-cache hits
    are not computed) and `num_generated_tokens` every output token: a lane's work per second
    (bench_lanes reads both from the workers' heartbeats)."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[300 + i for i in range(40)], [900 + i for i in range(70)]]
    before = llm.stats()
    outs = llm.generate(prompts, params)
    mid = llm.stats()
    assert mid["num_generated_tokens"] - before["num_generated_tokens"] == 10
    assert mid["num_prefill_tokens"] - before["num_prefill_tokens"] == 110
    assert [len(o.token_ids) for o in outs] == [5, 5]
    llm.generate(prompts[1:], params)  # again: its full blocks come from the prefix cache
    after = llm.stats()
    hits = after["prefix_cache_hits"] - mid["prefix_cache_hits"]
    assert hits > 0 and after["num_prefill_tokens"] - mid["num_prefill_tokens"] == 70 - hits


def test_embed_equals_transformers_pooling_chunked_and_frees_its_blocks(
    base_llm, make_llm, smollm2_dir
) -> None:
    """`LLM.embed` (prefill-only embed requests) against transformers' `last_hidden_state` with
    the same pooling, float32: LAST on the shared engine, MEAN on one whose 16-token budget
    chunks every prompt (the sum must carry across chunks); no
    KV block stays held."""
    import numpy as np
    import torch
    from transformers import AutoModel

    texts = ["The cat sat on the mat.", "Embeddings map text to vectors. " * 6, "hi"]
    hf = AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    def reference(ids: list[int], mode: str) -> np.ndarray:
        with torch.inference_mode():
            h = hf(torch.tensor([ids])).last_hidden_state[0]
        pooled = h[-1] if mode == "LAST" else h.mean(0)
        return torch.nn.functional.normalize(pooled, dim=0).numpy()

    for llm, mode in ((base_llm, "LAST"), (make_llm(pooling_type="MEAN",
                                                    max_num_batched_tokens=16), "MEAN")):  # fmt: skip
        outs = llm.embed(texts)
        assert [o.finish_reason for o in outs] == ["stop"] * 3
        for out in outs:
            got = np.array(out.embedding)
            assert got.shape == (576,) and out.token_ids == []
            assert np.abs(got - reference(out.prompt_token_ids, mode)).max() < 1e-4, mode
            assert out.metrics["tpot_ms"] is None and out.metrics["completion_tokens"] == 0
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def _run_one(engine, request) -> list:
    engine.add(request)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request.request_id]
    return outs


def test_resumed_request_goes_on_token_exact(llm):
    """A request resumed with the tokens an earlier attempt generated (a lost worker's,
    `EngineRequest.output_token_ids`) ends as the uninterrupted one did: the same next tokens,
    only the text not yet sent, penalties counting the resumed tokens as output, and its
    metrics over the whole output."""
    from laneserve.contracts.engine_io import EngineRequest

    engine = llm.engine
    prompt = engine.prompts.encode(prompt="Write a short poem about the sea.")
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=1.5)
    full = _run_one(engine, EngineRequest("full", prompt, sp.to_dict()))
    ids = [t for o in full for t in o.new_token_ids]
    assert len(ids) == 24 and full[-1].finish_reason == "length"
    for k in (1, 9, 23):
        sent = "".join(o.new_text for o in full[:k])  # one token an output without drafts
        assert [t for o in full[:k] for t in o.new_token_ids] == ids[:k]
        rest = _run_one(engine, EngineRequest(f"r{k}", prompt, sp.to_dict(),
                                              output_token_ids=ids[:k]))  # fmt: skip
        assert [t for o in rest for t in o.new_token_ids] == ids[k:], k
        assert sent + "".join(o.new_text for o in rest) == "".join(o.new_text for o in full)
        assert rest[-1].finish_reason == "length"
        assert rest[-1].metrics["completion_tokens"] == 24
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        engine.add(EngineRequest("bad", prompt, sp.to_dict(), output_token_ids=[10**9]))
    with pytest.raises(PromptTooLongError):
        engine.add(EngineRequest("long", prompt, sp.to_dict(), output_token_ids=[5] * 256))
    assert not engine.has_unfinished_requests()
