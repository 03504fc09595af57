"""Properties of the incremental detokenizer on the real SmolLM2 (byte-level BPE) tokenizer.

Texts mix ASCII, CJK, emoji (with ZWJ sequences and skin tones), combining marks and Greek/Cyrillic;
their token sequences come from the tokenizer itself or from random splits of the UTF-8 bytes into
byte-level tokens (so characters are cut anywhere). Streamed token by token or in random chunks:
joined deltas equal the full decode, no delta holds U+FFFD, the offsets never move backwards, and
a stop string cuts the text at its first occurrence.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laneserve.gpu_worker.detokenizer import IncrementalDetokenizer
from laneserve.gpu_worker.sampling_params import SamplingParams
from tests.engine_props.props_helpers import prop_settings

ALPHABET = (
    list("abc XYZ 019 .,!?\n\t")
    + list("你好世界日本語中文字")
    + ["🎉", "👍", "🤖", "👍🏽", "👨\u200d👩\u200d👧", "🏳\ufe0f\u200d🌈"]
    + ["e\u0301", "a\u0308", "n\u0303", "\u0301", "\u0327"]  # combining marks, one bare
    + list("ΕλληνικάПривет")
)
texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=24).map("".join)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE token alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


BYTE_CHARS = bytes_to_unicode()


@pytest.fixture(scope="module")
def vocab(tokenizer):
    table = tokenizer.get_vocab()
    # every byte of UTF-8 text in Unicode planes 0 and 1 (the vocabulary lacks 0xC0, 0xC1,
    # 0xF1, 0xF2, 0xF5..0xFF and some control bytes)
    needed = [9, 10, *range(0x20, 0x7F), *range(0x80, 0xC0), *range(0xC2, 0xF1)]
    assert all(BYTE_CHARS[b] in table for b in needed), "not a byte-level BPE vocabulary"
    return table


def byte_level_ids(vocab, data: bytes, cuts: list[int]) -> list[int]:
    """Token ids for `data` split at `cuts`; a piece that is no token becomes single bytes."""
    ids: list[int] = []
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        piece = "".join(BYTE_CHARS[b] for b in data[lo:hi])
        if piece in vocab:
            ids.append(vocab[piece])
        else:
            ids.extend(vocab[BYTE_CHARS[b]] for b in data[lo:hi])
    return ids


def stream(tokenizer, ids, prompt, chunks, params=None):
    """Feed `ids` in chunks of the given sizes (cycled); return deltas, offsets, detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params or SamplingParams())
    deltas, offsets, i, k = [], [(detok.prefix_offset, detok.read_offset)], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)]
        k += 1
        upd = detok.update(ids[i : i + size])
        i += size
        deltas.append(upd.delta_text)
        offsets.append((detok.prefix_offset, detok.read_offset))
        if upd.stop_matched:
            break
    deltas.append(detok.flush())
    return deltas, offsets, detok


def check_stream(deltas, offsets, detok, expected):
    assert "".join(deltas) == expected == detok.output_text
    assert not any("\ufffd" in d for d in deltas), deltas
    for (p0, r0), (p1, r1) in zip(offsets, offsets[1:], strict=False):
        assert p0 <= p1 <= r1 and r0 <= r1, offsets


CHUNKS = st.lists(st.integers(1, 4), min_size=1, max_size=4)
CUTS = st.lists(st.integers(0, 400), max_size=30)  # byte offsets (mod the length) to split at
PROMPTS = st.sampled_from(["", "Hello there.", "日本語で", "Say 👍:"])


def check_full_decode(tokenizer, ids, text, prompt, chunks):
    full = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert full == text
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    check_stream(*stream(tokenizer, ids, prompt_ids, chunks), full)


@prop_settings(120)
@given(text=texts, prompt=PROMPTS, chunks=CHUNKS)
def test_tokenizer_ids_stream_to_the_full_decode(tokenizer, text, prompt, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_full_decode(tokenizer, ids, text, prompt, chunks)


@prop_settings(150)
@given(text=texts, cuts=CUTS, prompt=PROMPTS, chunks=CHUNKS)
def test_random_byte_splits_stream_to_the_full_decode(tokenizer, vocab, text, cuts, prompt, chunks):
    check_full_decode(tokenizer, byte_level_ids(vocab, text.encode(), cuts), text, prompt, chunks)


@prop_settings(120)
@given(
    text=texts,
    cuts=CUTS,
    span=st.tuples(st.integers(0, 100), st.integers(1, 4)),
    include=st.booleans(),
    chunks=CHUNKS,
)
def test_stop_string_cuts_at_its_first_occurrence(
    tokenizer, vocab, text, cuts, span, include, chunks
):
    start = span[0] % len(text)
    stop = text[start : start + span[1]]
    ids = byte_level_ids(vocab, text.encode(), cuts)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    deltas, offsets, detok = stream(tokenizer, ids, [], chunks, params)
    at = text.find(stop)
    expected = text[: at + len(stop)] if include else text[:at]
    check_stream(deltas, offsets, detok, expected)
    assert detok.stop_matched == stop
