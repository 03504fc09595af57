"""Speculative decoding (n-gram prompt lookup) on the bundled model in float32: lossless.

Every test compares the speculating engine with the plain one (`base_llm`) token for token and
checks that drafts were really verified and accepted where the text is copied, so equality is not
the trivial "speculation never happened". check_integrity() runs after each test (conftest).
"""

from __future__ import annotations

import pytest

from laneserve.gpu_worker import SamplingParams
from laneserve.gpu_worker.config import EngineConfig, EngineConfigError, SpeculativeConfig

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
    "and wrote the weather in a leather logbook."
)
COPY = [{"role": "user", "content": f"Repeat this sentence exactly:\n\n{PASSAGE}"}]
SHORT_COPY = [
    {"role": "user", "content": "Repeat exactly: The quick brown fox jumps over the lazy dog."}
]
CHAT = [{"role": "user", "content": "Name three colours."}]
UNICODE = [{"role": "user", "content": "Repeat exactly: 東京は日本の首都です。 Café ☕ naïve 😀!"}]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def llm(make_llm):
    """Speculation forced on (adaptive off): every proposal is verified."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    return make_llm(speculative_config=spec)


def _run(llm, conversations, params):
    return llm.chat(conversations, params)


def _key(out):
    return (out.token_ids, out.text, out.finish_reason)


def _stream(llm, conversation, params) -> list[tuple[list[int], str, bool]]:
    """(token ids, text, finished) of every delta of one request, through `LLMEngine.step`."""
    engine = llm.engine
    ids = engine.prompts.encode(messages=conversation)
    engine.add_request("stream-1", ids, sampling_params=params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [(d.new_token_ids, d.new_text, d.finished) for d in engine.step()]
    return deltas


@pytest.mark.slow
def test_greedy_mixed_batch_is_token_identical_and_copies_accept_drafts(llm, base_llm):
    """Copy-heavy, mostly-rejected (open chat) and multi-byte prompts in one batch."""
    convs = [COPY, CHAT, UNICODE, SHORT_COPY]
    on, off = _run(llm, convs, GREEDY), _run(base_llm, convs, GREEDY)
    assert [_key(o) for o in on] == [_key(o) for o in off]
    copy = on[0].metrics
    assert (
        copy["spec_draft_tokens"] >= 8
        and copy["spec_accepted_tokens"] >= 0.5 * copy["spec_draft_tokens"]
    ), copy
    assert "\ufffd" not in on[2].text
    assert all(o.metrics["spec_accepted_tokens"] <= o.metrics["spec_draft_tokens"] for o in on)
    assert all(o.metrics["spec_draft_tokens"] == 0 for o in off)
    st = llm.stats()
    assert st["spec_accepted_tokens"] >= copy["spec_accepted_tokens"]
    assert st["num_free_blocks"] == st["num_total_blocks"]  # no block leak


def test_streaming_deltas_carry_accepted_runs_and_add_up(llm, base_llm):
    deltas = _stream(llm, COPY, GREEDY)
    off = _run(base_llm, [COPY], GREEDY)[0]
    assert [t for ids, _, _ in deltas for t in ids] == off.token_ids
    assert "".join(text for _, text, _ in deltas) == off.text
    assert max(len(ids) for ids, _, _ in deltas) >= 3  # several tokens in one step
    assert sum(fin for _, _, fin in deltas) == 1 and deltas[-1][2]


def _inside_run(deltas) -> int:
    """Index (in the output) of a token in the middle of a multi-token delta whose id does not
    occur earlier in the output."""
    out: list[int] = []
    for ids, _, _ in deltas:
        for j, t in enumerate(ids):
            if 0 < j < len(ids) - 1 and t not in out and len(out) >= 2:
                return len(out)
            out.append(t)
    raise AssertionError(f"no multi-token delta: {deltas}")


def test_stop_id_stop_string_and_max_tokens_cut_inside_an_accepted_run(llm, base_llm):
    deltas = _stream(llm, COPY, GREEDY)
    tokens = [t for ids, _, _ in deltas for t in ids]
    i = _inside_run(deltas)
    stop_word = llm.tokenizer.decode(tokens[i - 1 : i + 1]).strip()
    cases = [
        SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[tokens[i]]),
        SamplingParams(max_tokens=i + 1, temperature=0.0),
        SamplingParams(max_tokens=32, temperature=0.0, stop=[stop_word]),
    ]
    for params in cases:
        on, off = _run(llm, [COPY], params)[0], _run(base_llm, [COPY], params)[0]
        assert _key(on) == _key(off), params
        assert len(on.token_ids) <= i + 1 and on.metrics["spec_accepted_tokens"] > 0, params
    assert _run(llm, [COPY], cases[0])[0].token_ids[-1] == tokens[i]
    assert _run(llm, [COPY], cases[2])[0].finish_reason == "stop"


def test_eos_inside_an_accepted_run_ends_the_request(llm, base_llm):
    """The copied sentence is followed by <|im_end|> in the prompt, so the draft that ends the
    copy carries the EOS id: the run stops at it."""
    params = SamplingParams(max_tokens=64, temperature=0.0)
    on, off = _run(llm, [SHORT_COPY], params)[0], _run(base_llm, [SHORT_COPY], params)[0]
    assert _key(on) == _key(off)
    assert on.finish_reason == "stop" and on.token_ids[-1] in llm.engine.eos_token_ids
    deltas = _stream(llm, SHORT_COPY, params)
    assert len(deltas[-1][0]) >= 2, deltas  # the EOS came with accepted drafts


def test_preemption_mid_run_recomputes_to_the_same_tokens(llm, base_llm):
    engine = llm.engine
    engine.add_request("pre-1", engine.prompts.encode(messages=COPY), GREEDY)
    tokens: list[int] = []
    preempted = False
    before = engine.stats()["num_preemptions"]
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens += d.new_token_ids
        if not preempted and len(tokens) >= 6:
            preempted = engine.scheduler.preempt_request("pre-1")
    assert preempted and engine.stats()["num_preemptions"] == before + 1
    assert tokens == _run(base_llm, [COPY], GREEDY)[0].token_ids


def test_prefix_cache_serves_only_accepted_kv(llm, base_llm):
    """Blocks filled during speculative decode steps are hit by a later prompt that extends the
    first request's output; its continuation equals the plain engine's."""
    before = llm.stats()
    first = _run(llm, [COPY], GREEDY)[0]
    m = first.metrics
    assert m["spec_accepted_tokens"] > 0
    # every verification carried 1..k drafts; the engine's totals grew by this request's
    assert m["spec_num_drafts"] <= m["spec_draft_tokens"] <= 4 * m["spec_num_drafts"], m
    after = llm.stats()
    for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_num_drafts"):
        assert after[key] - before[key] == m[key], key
    prompt = llm.engine.apply_chat_template(COPY) + first.token_ids[:-1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    on = llm.generate([prompt], params)[0]
    off = base_llm.generate([prompt], params)[0]
    block = llm.engine.config.block_size
    assert on.num_cached_tokens > len(prompt) - len(first.token_ids) + block  # decode blocks hit
    assert on.token_ids == off.token_ids


@pytest.mark.slow
def test_seeded_sampling_same_alone_in_a_batch_and_without_speculation(llm, base_llm):
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    other = SamplingParams(max_tokens=24, temperature=1.0)
    alone = _run(llm, [COPY], seeded)[0]
    batch = _run(llm, [CHAT, COPY, SHORT_COPY], [other, seeded, other])[1]
    plain = _run(base_llm, [COPY], seeded)[0]
    assert _key(alone) == _key(batch) == _key(plain)
    assert alone.metrics["spec_draft_tokens"] > 0


def test_speculative_config_checks():
    assert EngineConfig().speculative_config is None  # off unless asked
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    for bad, match in (
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"lookahead": 2}, "unknown"),
        ("{not json", "not JSON"),
        ([1], "object"),
    ):
        with pytest.raises(EngineConfigError, match=match):
            EngineConfig(speculative_config=bad)


def test_constrained_requests_are_not_speculated_beside_speculated_ones(llm, base_llm):
    """Structured outputs in a speculating engine: the constrained request gets no drafts and
    its output parses; the copy request beside it still verifies drafts and keeps its tokens."""
    import json

    from laneserve.contracts.openai.structured import parse_structured

    spec = parse_structured({"response_format": {"type": "json_object"}})
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec)
    ask_json = [{"role": "user", "content": "Describe a lighthouse as a JSON object."}]
    copy_on, json_on = llm.chat([COPY, ask_json], [GREEDY, constrained])
    copy_off, json_off = base_llm.chat([COPY, ask_json], [GREEDY, constrained])
    assert _key(copy_on) == _key(copy_off)
    assert copy_on.metrics["spec_draft_tokens"] > 0
    assert json_on.metrics["spec_draft_tokens"] == 0
    assert _key(json_on) == _key(json_off)
    if json_on.finish_reason == "stop":
        assert isinstance(json.loads(json_on.text), dict)


def test_slo_budgets_leave_room_for_drafts_and_the_profile_counts_none(
    make_llm, base_llm, monkeypatch
):
    """Under the SLO controller (the stack's default) a lone stream's steps once had a budget
    of 2 tokens, so every verification carried one draft whatever `num_speculative_tokens`
    said; and the start-up profile's own drafts showed in the totals (/metrics) before any
    request."""
    monkeypatch.setenv("LANESERVE_STEP_COST_CACHE", "0")  # this start profiles
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    llm = make_llm(slo_control=True, speculative_config=spec)
    # whether or not the profile drafted, its reset zeroes the totals
    c = llm.engine.speculation.controller
    c.num_draft_tokens, c.num_accepted_tokens, c.num_drafts = 9, 7, 3
    from laneserve.gpu_worker.step_profile import _reset_after_profile

    _reset_after_profile(llm.engine)
    st = llm.stats()
    assert [st[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "spec_num_drafts")] == [
        0, 0, 0,
    ]  # fmt: skip
    on = _run(llm, [COPY], GREEDY)[0]
    m = on.metrics
    assert m["spec_draft_tokens"] >= 2 * m["spec_num_drafts"] > 0, m
    assert _key(on) == _key(_run(base_llm, [COPY], GREEDY)[0])
    llm.check_integrity()
