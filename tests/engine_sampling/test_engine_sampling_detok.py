"""IncrementalDetokenizer on the real SmolLM2 tokenizer: UTF-8 safety, stop strings, hold-back."""

from __future__ import annotations

import random

import pytest

from laneserve.gpu_worker.detokenizer import IncrementalDetokenizer
from laneserve.gpu_worker.sampling_params import SamplingParams

MULTILINGUAL = "你好，世界！🎉👍 naïve café — 日本語のテキスト 🤖🧠 Ελληνικά 👨‍👩‍👧 done."


def stream(tokenizer, ids, params=None, prompt=(), one_at_a_time=True):
    """Feed ids like the engine does; return (deltas, detokenizer). Stops at a stop match."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    deltas = []
    chunks = [[i] for i in ids] if one_at_a_time else [list(ids)]
    offsets = []
    for chunk in chunks:
        upd = detok.update(chunk)
        deltas.append(upd.delta_text)
        offsets.append((detok.prefix_offset, detok.read_offset))
        if upd.stop_matched:
            break
    else:
        deltas.append(detok.flush())
    detok.offsets = offsets
    return deltas, detok


def test_multibyte_split_across_tokens(tokenizer):
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    # the test is only meaningful if byte-level BPE really splits characters across tokens
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert len(partial) >= 5, pieces
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    for context in ((), prompt_ids):
        deltas, detok = stream(tokenizer, ids, prompt=context)
        assert "".join(deltas) == tokenizer.decode(ids) == MULTILINGUAL
        assert detok.output_text == MULTILINGUAL
        assert all("\ufffd" not in d for d in deltas)
        assert "" in deltas  # some tokens emitted nothing: their character was incomplete
        for (p0, r0), (p1, r1) in zip(detok.offsets, detok.offsets[1:], strict=False):
            assert p1 >= p0 and r1 >= r0 and p1 <= r1


def test_all_at_once_equals_one_at_a_time(tokenizer):
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids, one_at_a_time=False)
    assert "".join(deltas) == MULTILINGUAL


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    ids = ids + [tokenizer.eos_token_id] + tokenizer.encode(" again", add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "Hello there again"
    deltas, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == tokenizer.decode(ids) == f"Hello there{tokenizer.eos_token} again"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)  # the same replacement char a full decode gives
    assert "\ufffd" not in "".join(deltas[:-1])  # ... and only from flush()


def longer_token_cases(tokenizer, text, n):
    """(index, token text) of tokens of >= 3 chars whose first n chars first occur at that token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    cases = []
    for k in range(1, len(ids)):
        before, token = tokenizer.decode(ids[:k]), tokenizer.decode([ids[k]])
        if len(token) >= 3 and (before + token).find(token[:n]) == len(before):
            cases.append((k, token))
    return ids, cases


@pytest.mark.parametrize("prefix_len", [1, 2])
def test_stop_string_inside_longer_token_cuts_before_it(tokenizer, prefix_len):
    text = "The capital of France is Paris.\nRome hosts Vatican City;Kyoto was Japan's (Heian) capital."
    ids, cases = longer_token_cases(tokenizer, text, prefix_len)
    assert len(cases) >= 2, cases
    for k, token in cases:
        stop = token[:prefix_len]
        deltas, detok = stream(tokenizer, ids, SamplingParams(stop=[stop]))
        assert detok.stop_matched == stop
        assert "".join(deltas) == detok.output_text == tokenizer.decode(ids[:k])
        assert len(deltas) == k + 1  # it stopped on the token that contains the stop string


def test_stop_string_spanning_two_tokens(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = [tokenizer.decode([i]) for i in ids]
    assert "".join(tokens) == text
    spanning = []  # last 2 chars of token k + first 2 chars of token k + 1, unique in the text
    for k in range(len(ids) - 1):
        stop = tokens[k][-2:] + tokens[k + 1][:2]
        if len(stop) == 4 and text.count(stop) == 1:
            spanning.append(stop)
    assert len(spanning) >= 3
    for stop in spanning:
        for include in (False, True):
            params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
            deltas, detok = stream(tokenizer, ids, params)
            end = text.index(stop) + (len(stop) if include else 0)
            assert "".join(deltas) == detok.output_text == text[:end]
            assert detok.stop_matched == stop


def test_count_to_ten_with_stop_seven(tokenizer):
    text = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, SamplingParams(stop=["7"]))
    assert "".join(deltas) == "1, 2, 3, 4, 5, 6, " and detok.stop_matched == "7"
    deltas, detok = stream(
        tokenizer, ids, SamplingParams(stop=["7"], include_stop_str_in_output=True)
    )
    assert "".join(deltas) == "1, 2, 3, 4, 5, 6, 7"
    assert detok.update(tokenizer.encode(" 8", add_special_tokens=False)).delta_text == ""


def test_text_held_back_while_it_may_start_a_stop_string(tokenizer):
    text = "I love Paris. Paris is nice"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["Paris!", "nice day"]))
    emitted = ""
    for i in ids:
        upd = detok.update([i])
        assert upd.stop_matched is None
        emitted += upd.delta_text
        # nothing that could still begin a stop string is out; everything else is
        tail = detok.output_text[len(emitted) :]
        assert detok.output_text.startswith(emitted)
        assert tail == "" or any(s.startswith(tail) for s in ("Paris!", "nice day"))
    assert emitted == "I love Paris. Paris is "  # "nice" may still become "nice day"
    assert detok.flush() == "nice"
    assert detok.flush() == ""
    assert emitted + "nice" == text


def test_eos_stop_terminated_flushes_and_omits_eos_text(tokenizer):
    ids = tokenizer.encode("See you tomorrow", add_special_tokens=False)
    params = SamplingParams(stop=["tomorrow!"], skip_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    text = "".join(detok.update([i]).delta_text for i in ids)
    assert text == "See you "
    upd = detok.update([tokenizer.eos_token_id], stop_terminated=True)
    assert upd.delta_text == "tomorrow" and upd.stop_matched is None and detok.finished
    assert detok.output_text == "See you tomorrow"


def test_earliest_stop_wins(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, SamplingParams(stop=["delta", "beta", "gamma"]))
    assert "".join(deltas) == "alpha " and detok.stop_matched == "beta"


def test_random_stops_match_reference(tokenizer):
    """Property: streamed output == full text cut at the first completed stop string."""
    rng = random.Random(0)
    corpus = [
        MULTILINGUAL,
        "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
        "Summary: The report finds that 42% of users prefer dark mode; see §3.2 for details.",
    ]
    for _ in range(60):
        text = rng.choice(corpus)
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 4)] or "x")
        if rng.random() < 0.3:
            stops.append("no such stop")
        include = rng.random() < 0.5
        ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        end, start, _ = min(ends)
        expected = text[:end] if include else text[:start]
        deltas, detok = stream(
            tokenizer, ids, SamplingParams(stop=stops, include_stop_str_in_output=include)
        )
        assert "".join(deltas) == detok.output_text == expected, (text, stops, include)
        assert all("\ufffd" not in d for d in deltas)


def test_no_stop_string_match_within_min_tokens(tokenizer):
    text = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first = text.index("2")
    k = next(k for k in range(len(ids)) if len(tokenizer.decode(ids[: k + 1])) > first)
    # "2" arrives with token k+1 (1-based); min_tokens = k+1 forbids stopping there, so "7" stops
    deltas, detok = stream(tokenizer, ids, SamplingParams(stop=["2", "7"], min_tokens=k + 1))
    assert "".join(deltas) == "1, 2, 3, 4, 5, 6, " and detok.stop_matched == "7"
    deltas, detok = stream(tokenizer, ids, SamplingParams(stop=["2", "7"], min_tokens=k))
    assert "".join(deltas) == "1, " and detok.stop_matched == "2"


def test_resume_at_every_cut_emits_exactly_what_was_not_sent(tokenizer):
    """A request resumed on another worker (`resume`): at every cut, what the first attempt
    emitted plus what the resumed detokenizer emits is the whole text once, also where the cut
    splits a UTF-8 character and where a stop string falls inside `min_tokens`."""
    cases = [
        (tokenizer.encode("Hi 日本 " + MULTILINGUAL, add_special_tokens=False), SamplingParams()),
        (tokenizer.encode("a. b c d e f g h.", add_special_tokens=False),
         SamplingParams(stop=["."], min_tokens=5)),
        (tokenizer.encode("Well, the capital of France is Paris!", add_special_tokens=False),
         SamplingParams(stop=["Paris!"])),
    ]  # fmt: skip
    for ids, params in cases:
        whole, _ = stream(tokenizer, ids, params)
        for k in range(1, len(ids)):
            first, detok = stream(tokenizer, ids[:k], params)
            sent = "".join(first[:-1])  # a lost worker never flushed its held-back text
            again = IncrementalDetokenizer(tokenizer, [], params)
            again.resume(ids[:k])
            rest = []
            for t in ids[k:]:
                upd = again.update([t])
                rest.append(upd.delta_text)
                if upd.stop_matched:
                    break
            else:
                rest.append(again.flush())
            assert sent + "".join(rest) == "".join(whole), (k, params.stop)
