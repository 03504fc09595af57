"""Structured outputs in the engine (gpu_worker/structured_output.py) on the bundled SmolLM2 in
float32: grammar-constrained rows always give valid output, unconstrained rows of the same batch
are untouched, preemption does not advance a grammar twice, the compile cache stays bounded."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from laneserve.contracts.openai.structured import parse_structured
from laneserve.gpu_worker import SamplingParams
from laneserve.gpu_worker.sampler import Sampler
from laneserve.gpu_worker.structured_output import GrammarCompiler, GrammarMask, batch_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "score", "role", "address", "tags"],
    "additionalProperties": False,
}


def schema_spec(schema: dict) -> dict:
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }
    return parse_structured(body)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(max_model_len=512, num_blocks=256)


@pytest.mark.slow
def test_json_schema_outputs_always_validate(llm):
    spec = schema_spec(PERSON)
    greedy = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=spec)
    sampled = SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured_outputs=spec)
    prompts = ["Describe a user as JSON.", "Invent a person.", "Say hello.", "Who are you?"]
    outs = llm.chat([ask(p) for p in prompts], [greedy, greedy, greedy, sampled])
    for out in outs:
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_choice_and_regex(llm):
    obj = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json_object": True})
    choice = ["positive", "negative", "neutral"]
    outs = llm.chat(
        [
            ask("Give a JSON object with a key a."),
            ask("I love this film. Sentiment?"),
            ask("Phone?"),
        ],
        [
            obj,
            SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"choice": choice}),
            SamplingParams(
                max_tokens=12,
                temperature=0.0,
                structured_outputs={"regex": r"\+1 [0-9]{3}-[0-9]{4}"},
            ),
        ],
    )
    if outs[0].finish_reason == "stop":  # an open object may run out of tokens; then only a prefix
        assert isinstance(json.loads(outs[0].text), dict)
    else:
        assert outs[0].text.lstrip().startswith("{")
    assert outs[1].text in choice and outs[1].finish_reason == "stop"
    assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", outs[2].text), outs[2].text


def test_unconstrained_rows_get_their_solo_tokens(llm):
    plain = [ask("Name three fruits."), ask("What is 2 + 2?")]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    solo = [llm.chat([m], greedy)[0].token_ids for m in plain]
    constrained = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=schema_spec(PERSON)
    )
    mixed = llm.chat(
        [plain[0], ask("A person, please."), plain[1], ask("Another person.")],
        [greedy, constrained, greedy, constrained],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == solo


def test_preemption_replays_without_advancing_the_grammar_twice(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=schema_spec(PERSON))
    ids = engine.apply_chat_template(ask("Describe a person."))
    expected = llm.generate([ids], params)[0]
    engine.add_request("pre", prompt_token_ids=ids, sampling_params=params)
    tokens, text, preempted, reason = [], "", False, None
    for _ in range(400):
        for d in engine.step():
            if d.request_id == "pre":
                tokens += d.new_token_ids
                text += d.new_text
                reason = d.finish_reason if d.finished else reason
        if len(tokens) >= 8 and not preempted:
            assert engine.scheduler.preempt_request("pre")
            preempted = True
        if reason is not None:
            break
    assert preempted and reason == expected.finish_reason
    assert tokens == expected.token_ids and text == expected.text


def test_a_grammar_that_admits_nothing_fails_alone(llm):
    good = SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs={"choice": ["yes", "no"]}
    )
    bad = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"json": '{"$ref":"#"}'})
    outs = llm.chat([ask("Yes or no?"), ask("Anything.")], [good, bad])
    assert outs[0].text in ("yes", "no")
    assert outs[1].finish_reason == "error" and "admits no output" in outs[1].error


def test_greedy_rows_skip_their_masks_and_pick_the_masked_argmax(llm):
    """Greedy constrained rows are sampled without a mask, and again with it only where the
    grammar refuses the pick: token for token what the masked path gives (top_k 1 at
    temperature 1 samples the masked argmax, its mask computed during the forward pass). The
    regex refuses the model's first pick (a word, not a digit), so the redo path runs too."""
    structured = llm.engine.structured
    prompts = [ask("Describe a user as JSON."), ask("Invent a person."), ask("Say hello.")]
    specs = [schema_spec(PERSON), schema_spec(PERSON), {"regex": r"[0-9]{3}-[a-z]{4}"}]
    greedy = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=s) for s in specs]
    masked = [SamplingParams(max_tokens=80, temperature=1.0, top_k=1, seed=0,
                             structured_outputs=s) for s in specs]  # fmt: skip
    counts = ("num_greedy_rows", "num_forced_rows", "num_refused_rows")
    before = [getattr(structured, c) for c in counts]
    fast = llm.chat(prompts, greedy)
    rows, forced, refused = (
        getattr(structured, c) - b for c, b in zip(counts, before, strict=True)
    )
    assert rows == sum(len(o.token_ids) for o in fast)
    assert forced > 0 and 0 < refused < rows / 2, (rows, forced, refused)  # most: no mask
    slow = llm.chat(prompts, masked)
    assert structured.num_greedy_rows - before[0] == rows  # the masked path's rows are apart
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", fast[2].text), fast[2].text


def test_a_grammar_the_model_keeps_refusing_computes_its_masks_beside_the_forward(llm):
    """Capitals only, asked for a greeting: the model's picks are refused again and again, so
    after `MAX_REFUSALS` in a row the row computes its mask first for `MASKED_STEPS` steps
    (no pick to check, no second sampling); the tokens stay the masked path's."""
    from laneserve.gpu_worker.structured_output import MAX_REFUSALS

    structured, spec = llm.engine.structured, {"regex": "[A-Z]{24}"}
    rows_before, refused_before = structured.num_greedy_rows, structured.num_refused_rows
    fast = llm.chat([ask("Say hello.")], SamplingParams(max_tokens=24, temperature=0.0,
                                                        structured_outputs=spec))[0]  # fmt: skip
    rows = structured.num_greedy_rows - rows_before
    refused = structured.num_refused_rows - refused_before
    assert re.fullmatch("[A-Z]+", fast.text), fast.text
    assert refused >= MAX_REFUSALS and rows < len(fast.token_ids), (rows, refused)
    slow = llm.chat([ask("Say hello.")], SamplingParams(max_tokens=24, temperature=1.0, top_k=1,
                                                        structured_outputs=spec))[0]  # fmt: skip
    assert fast.token_ids == slow.token_ids


def test_allows_agrees_with_the_mask_on_every_token(llm):
    """`GrammarMatcher.greedy_pick(t) == t` (what a greedy row's pick is checked with) is bit
    t of the step's mask, for every token id, at steps of a constrained output (forced bytes,
    whose mask holds one tokenization, among them) and at its end (EOS)."""
    vocab = llm.engine.model_config.vocab_size
    compiler = GrammarCompiler(llm.tokenizer, vocab, sorted(llm.engine.eos_token_ids))
    spec = schema_spec(PERSON)
    out = llm.chat([ask("Invent a person.")], SamplingParams(
        max_tokens=120, temperature=0.0, structured_outputs=spec))[0]  # fmt: skip
    assert out.finish_reason == "stop"
    matcher = compiler.matcher(spec)
    forced = checked = 0
    last = len(out.token_ids) - 1
    for i, token in enumerate(out.token_ids):
        if i < 6 or i % 8 == 0 or i == last:  # ~0.5 s a step over the whole vocabulary
            mask = batch_bitmask([matcher], vocab).bitmask[0]
            bits = (mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
            expected = bits.flatten()[:vocab].bool().tolist()
            assert [matcher.greedy_pick(t) == t for t in range(vocab)] == expected, i
            forced += sum(expected) == 1
            checked += 1
        assert matcher.accept([token]) == 1
    assert 0 < forced < checked
    eos = min(llm.engine.eos_token_ids)
    assert matcher.is_accepting and matcher.greedy_pick(eos) == eos


def test_matcher_speculative_helpers(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, [2])
    matcher = compiler.matcher({"regex": "ab+c"})
    tok = llm.tokenizer.convert_tokens_to_ids
    a, b, c, x = tok("a"), tok("b"), tok("c"), tok("x")
    bitmask = torch.zeros(4, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
    assert matcher.fill_bitmasks_with_drafts(bitmask, 0, [a, b, x]) == 2  # x breaks the grammar
    assert matcher.num_accepted == 0  # left where it was

    def allowed(row: int, token: int) -> bool:
        return bool((bitmask[row, token // 32] >> (token % 32)) & 1)

    assert allowed(0, a) and not allowed(0, b)
    assert allowed(1, b) and not allowed(1, c)  # after "a": b only
    assert allowed(2, b) and allowed(2, c) and not allowed(2, a)  # after "ab"
    assert bool((bitmask[3] == -1).all())  # after the invalid draft: unused, all allowed
    assert matcher.accept([a, b, x, c]) == 2 and matcher.num_accepted == 2
    matcher.rollback(1)
    assert matcher.accept([b, c]) == 2 and matcher.is_terminated
    with pytest.raises(ValueError):
        matcher.rollback(5)


def test_mask_applies_before_temperature_and_keeps_raw_logprobs():
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = (1 << 3) | (1 << 9)  # tokens 35 and 41 only
    mask = GrammarMask([1], bitmask)
    params = [SamplingParams(temperature=0.0, logprobs=0)] + [
        SamplingParams(temperature=2.0, top_k=5, seed=s, logprobs=0) for s in (1, 2)
    ]
    gens = [None] + [torch.Generator().manual_seed(s) for s in (1, 2)]
    out = Sampler([0])(logits, params, gens, [[1]] * 3, [[]] * 3, mask)
    alone = Sampler([0])(
        logits,
        params,
        [None] + [torch.Generator().manual_seed(s) for s in (1, 2)],
        [[1]] * 3,
        [[]] * 3,
    )
    assert out.token_ids[1] in (35, 41)
    assert out.token_ids[0] == alone.token_ids[0] and out.token_ids[2] == alone.token_ids[2]
    raw = torch.log_softmax(logits[1], dim=-1)[out.token_ids[1]].item()
    assert out.logprobs[1]["logprob"] == pytest.approx(raw)
    assert batch_bitmask([None, None], vocab) is None  # no grammar: nothing built


@pytest.mark.slow
def test_compile_cache_stays_bounded(llm):
    compiler = GrammarCompiler(
        llm.tokenizer, llm.engine.model_config.vocab_size, [2], cache_size=16
    )

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    def schema(i: int) -> dict:
        return {
            "json": json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        }

    for i in range(200):
        compiler.matcher(schema(i))
    before = rss_mb()
    for i in range(200, 1000):
        compiler.matcher(schema(i))
    assert len(compiler) == 16 and compiler.misses == 1000
    assert rss_mb() - before < 64, "memory grows with distinct schemas"
    compiler.matcher(schema(999))
    assert compiler.hits == 1
