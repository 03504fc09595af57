"""Incremental, UTF-8 safe detokenization with stop-string matching.

Algorithm (vLLM's `detokenize_incrementally`, from the HF text-generation-inference streamer):
keep the token strings of the sequence and two offsets into them,

    tokens:  [ ... | prefix_offset ........ read_offset ........ len(tokens) ]
                     \\__ already-emitted context __/ \\__ not yet emitted __/

and on each update decode `tokens[prefix_offset:]` and `tokens[prefix_offset:read_offset]`; the new
text is the difference. Decoding from a little context before the new tokens keeps decoders that
strip or merge at a sequence start (SentencePiece's leading "▁", byte-level merges) consistent with a
full decode. If the window ends in U+FFFD, the last token(s) hold only part of a multi-byte UTF-8
character (byte-level BPE splits CJK and emoji across tokens): nothing is emitted and the offsets stay
until the character completes. The offsets only ever move forward.

Stop strings are matched on the decoded text, so a stop string may end inside a token or span
several tokens. While the tail of the text could still be the beginning of a stop string it is held
back (not emitted); once a stop string matches, the text is cut right before it (or right after it
with `include_stop_str_in_output`). `flush()` releases the held-back text when generation ends for
another reason.

Tokenizer: a transformers fast tokenizer (`PreTrainedTokenizerFast` / transformers 5
`TokenizersBackend`): `convert_ids_to_tokens`, `convert_tokens_to_string`, `added_tokens_decoder`,
`all_special_ids`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from laneserve.gpu_worker.sampling_params import SamplingParams

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

# Prompt tokens decoded as context before the first output token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5, plus 2 spare as in vLLM's prompt conversion).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

_special_ids_cache: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class DetokenizerUpdate:
    """What one `update()` produced.

    Attributes:
        delta_text: text to stream now ("" when everything new is held back).
        stop_matched: the stop string that just matched (generation must finish with
            finish_reason "stop"), else None.
    """

    delta_text: str
    stop_matched: str | None


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas for one request.

    Args:
        tokenizer: a transformers fast tokenizer.
        prompt_token_ids: the request's prompt; its last few tokens are decoding context only.
        params: the request's `SamplingParams` (`stop`, `include_stop_str_in_output`,
            `skip_special_tokens`, `min_tokens` are used).

    Usage by the engine, per step: `upd = detok.update([token_id], stop_terminated=...)`; stream
    `upd.delta_text`; if `upd.stop_matched`, finish with reason "stop". When the request finishes
    for any other reason (length, EOS, stop token id, abort) call `flush()` and stream what it
    returns. After the finish, `output_text` equals the concatenation of all deltas.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.min_tokens = params.min_tokens
        self._num_output_tokens = 0  # all output ids seen, special ones included
        self._special_ids = _special_ids(tokenizer) if self.skip_special_tokens else frozenset()
        context = list(prompt_token_ids[-(_PROMPT_CONTEXT_TOKENS + 2) :])
        self._tokens: list[str] = self._to_tokens(context)
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        self._text = ""  # decoded output text (cut at the stop string once one matched)
        self._emitted = 0  # len of the prefix of _text already returned as deltas
        self._stop_matched: str | None = None
        self._finished = False

    # ---- public state ------------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """Decoded output so far, cut at the stop string once one matched.

        May include held-back text not yet emitted; after a stop match or `flush()` it equals the
        concatenation of all deltas.
        """
        return self._text

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended generation, if any."""
        return self._stop_matched

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `flush()` was called; later updates return ""."""
        return self._finished

    @property
    def prefix_offset(self) -> int:
        """Start of the decoding context window in the token-string list (never decreases)."""
        return self._prefix_offset

    @property
    def read_offset(self) -> int:
        """Tokens before this index are fully decoded into `output_text` (never decreases)."""
        return self._read_offset

    # ---- updates -----------------------------------------------------------------------------

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False
    ) -> DetokenizerUpdate:
        """Add newly generated tokens; return the text that can be streamed now.

        Args:
            new_token_ids: token ids generated since the last call (usually one).
            stop_terminated: the last id is EOS or one of `stop_token_ids` and generation ends
                with it: that token's text is left out (kept only with
                `include_stop_str_in_output`), and held-back text is flushed.

        Returns:
            `DetokenizerUpdate(delta_text, stop_matched)`.
        """
        if self._finished:
            return DetokenizerUpdate("", self._stop_matched)
        ids = list(new_token_ids)
        self._num_output_tokens += len(ids)
        if stop_terminated and ids and not self.include_stop_str_in_output:
            ids = ids[:-1]
        self._tokens.extend(self._to_tokens(ids))
        new_text = self._decode_new(final=stop_terminated)
        delta = self._append(new_text)
        if stop_terminated and self._stop_matched is None:
            delta += self.flush()
        return DetokenizerUpdate(delta, self._stop_matched)

    def resume(self, token_ids: Sequence[int]) -> None:
        """Take the tokens an earlier attempt of this request generated and sent (a request
        resumed on another worker), one at a time as that attempt's steps fed them, dropping
        their text: held-back text (a possible stop string, a partial UTF-8 character) stays
        held back, and `min_tokens` counts as it did there, so the next update emits exactly
        what the earlier attempt had not."""
        for token in token_ids:
            self.update([token])

    def flush(self) -> str:
        """Finish: decode any incomplete trailing bytes, release held-back text, return it.

        Returns "" after a stop string matched (nothing is held back then). Idempotent.
        """
        if self._finished:
            return ""
        delta = self._append(self._decode_new(final=True))
        self._finished = True
        rest = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta + rest

    # ---- internals ---------------------------------------------------------------------------

    def _to_tokens(self, ids: list[int]) -> list[str]:
        """Token strings of `ids`; an id the tokenizer does not know (a padded model vocabulary
        row beyond the tokenizer) decodes to "" (as vLLM), never to a decode error."""
        ids = [i for i in ids if i not in self._special_ids]
        if not ids:
            return []
        return [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def _decode_new(self, final: bool) -> str:
        """Text of `tokens[read_offset:]`, or "" while it ends in a partial character."""
        if self._read_offset == len(self._tokens):
            return ""
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(self._tokens[self._prefix_offset : self._read_offset])
        new_text = convert(self._tokens[self._prefix_offset :])
        if not final and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""  # a multi-byte character is still incomplete: wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def _append(self, new_text: str) -> str:
        """Add decoded text, match stop strings, return the part that can be emitted."""
        if not new_text:
            return ""
        self._text += new_text
        # as vLLM v1: no stop string match while the output has at most min_tokens tokens
        if self.stop and self._num_output_tokens > self.min_tokens:
            match = _find_stop(self._text, len(new_text), self.stop)
            if match is not None:
                start, stop_str = match
                end = start + len(stop_str) if self.include_stop_str_in_output else start
                self._text = self._text[:end]
                self._stop_matched = stop_str
                self._finished = True
                return self._take(len(self._text))
        if self.stop and not self.include_stop_str_in_output:
            held = _longest_stop_prefix_suffix(self._text, self.stop)
            return self._take(len(self._text) - held)
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        """Emit `_text[_emitted:upto]` (never moves backwards)."""
        if upto <= self._emitted:
            return ""
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta


def _find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest-completing stop string that ends within the last `num_new_chars` of `text`.

    Returns (start index, stop string) or None. Ties on the end position go to the match that
    starts first (the longer string).
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        first_start = max(0, len(text) - num_new_chars - len(stop) + 1)
        start = text.find(stop, first_start)
        if start < 0:
            continue
        key = (start + len(stop), start, stop)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids skipped by `skip_special_tokens`: added tokens marked special plus `all_special_ids`.

    Matches what `tokenizer.decode(ids, skip_special_tokens=True)` drops in the Rust backend.
    Cached per tokenizer (`all_special_ids` is recomputed on each access in transformers).
    """
    try:
        return _special_ids_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    result = frozenset(ids)
    try:
        _special_ids_cache[tokenizer] = result
    except TypeError:  # not weak-referenceable: just recompute next time
        pass
    return result
