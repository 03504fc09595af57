"""OpenAI response objects: chat/text completions, stream chunks, usage, logprobs, SSE framing.

Used by the gateway (responses and SSE streams) and by bulk-job output lines (the ``body`` of a
batch output line is the same completion object). ``kind`` is ``"chat"`` or ``"completion"``
(:attr:`laneserve.contracts.openai.requests.ParsedRequest.kind`). Logprob builders take ``token_text``, a
function from a token id to its text (:meth:`laneserve.contracts.openai.model.ServedModel.token_text`).

JSON never carries ``NaN`` or ``Infinity`` (they are not JSON): a ``-inf`` logprob is sent as
``-9999.0``, vLLM's convention (vllm/entrypoints/openai/serving_chat.py clamps to -9999.0), and
encoding uses ``allow_nan=False`` so a missed case fails loudly in tests instead of emitting
invalid JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from laneserve.contracts.openai.requests import ParsedRequest

TokenText = Callable[[int], str]
OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}

LOGPROB_FLOOR = -9999.0


# Characters JSON leaves raw with ensure_ascii=False that `str.splitlines` breaks lines at (and so
# httpx's `iter_lines`, which many SSE readers use): escaped, an event stays one line. One of them
# in a token's text once split a streamed chunk in two, and the soak's client failed on half a
# JSON object.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """Compact JSON (UTF-8 as is, but the line-breaking U+0085, U+2028 and U+2029 escaped);
    raises ValueError on NaN/Infinity."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.translate(_LINE_BREAKS)


def sse(obj: Any) -> bytes:
    """One server-sent event ``data: <json>\\n\\n``."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def clamp_logprob(value: Any) -> float:
    """A finite float for JSON: -inf / NaN / non-numbers -> -9999.0."""
    if type(value) not in (int, float) or math.isnan(value):
        return LOGPROB_FLOOR
    if value == math.inf:  # not a log-probability; keep the JSON valid all the same
        return 0.0
    return max(float(value), LOGPROB_FLOOR)


def _entries(raw: list | None) -> list[dict]:
    """Engine logprob entries ``{"token_id", "logprob", "top": [[id, lp], ...]}`` with their
    texts ``token`` and ``top_tokens`` (:mod:`laneserve.contracts.engine_io`); anything else is
    skipped."""
    return [e for e in raw or () if isinstance(e, dict) and isinstance(e.get("token_id"), int)]


def _texts(e: dict, token_text: TokenText) -> tuple[str, list[tuple[int, Any, str]]]:
    """An entry's token text and its valid top-n as (id, logprob, text): the engine's texts,
    ``token_text`` only for an entry that came without them (prompt logprobs, older workers)."""
    tok = e.get("token")
    if not isinstance(tok, str):
        tok = token_text(e["token_id"])
    texts = e.get("top_tokens")
    top = []
    for k, pair in enumerate(e.get("top") or ()):
        if isinstance(pair, list | tuple) and len(pair) == 2 and isinstance(pair[0], int):
            text = texts[k] if isinstance(texts, list) and k < len(texts) else None
            top.append((pair[0], pair[1], text if isinstance(text, str) else token_text(pair[0])))
    return tok, top


def chat_logprobs(raw: list | None, token_text: TokenText) -> dict:
    """``choice.logprobs`` of a chat completion: ``{"content": [{token, logprob, bytes,
    top_logprobs: [...]}]}``."""
    content = []
    for e in _entries(raw):
        tok, pairs = _texts(e, token_text)
        top = [
            {"token": t, "logprob": clamp_logprob(lp), "bytes": list(t.encode())}
            for _, lp, t in pairs
        ]
        content.append(
            {
                "token": tok,
                "logprob": clamp_logprob(e.get("logprob")),
                "bytes": list(tok.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def completion_logprobs(raw: list | None, token_text: TokenText, offset: int = 0) -> dict:
    """Legacy ``choice.logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token ->
    logprob maps), ``text_offset`` (character offsets, starting at ``offset``)."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for e in _entries(raw):
        tok, pairs = _texts(e, token_text)
        out["tokens"].append(tok)
        out["token_logprobs"].append(clamp_logprob(e.get("logprob")))
        out["top_logprobs"].append({t: clamp_logprob(lp) for _, lp, t in pairs})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def prompt_completion_logprobs(prompt_raw: list | None, token_text: TokenText) -> dict:
    """Legacy ``choice.logprobs`` of the prompt's tokens (``echo`` with ``logprobs``): the
    engine's prompt entries (the first has ``logprob`` None) -> ``tokens``, ``token_logprobs``
    (the first null, as OpenAI sends it), ``top_logprobs`` (the first null), ``text_offset``."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = 0
    for e in _entries(prompt_raw):
        if e.get("logprob") is None:
            tok = token_text(e["token_id"])
            for key, value in (("tokens", tok), ("token_logprobs", None), ("top_logprobs", None)):
                out[key].append(value)
            out["text_offset"].append(offset)
            offset += len(tok)
            continue
        one = completion_logprobs([e], token_text, offset)
        for key in out:
            out[key].extend(one[key])
        offset += len(one["tokens"][0])
    return out


def vllm_prompt_logprobs(prompt_raw: list | None, token_text: TokenText) -> list:
    """``choice.prompt_logprobs`` in vLLM's form: per prompt position null (the first) or
    ``{"<token_id>": {"logprob", "rank", "decoded_token"}}`` for the prompt token and the top-n
    (ranks 1..n)."""
    out: list[dict | None] = []
    for e in _entries(prompt_raw):
        if e.get("logprob") is None:
            out.append(None)
            continue
        d: dict[str, dict] = {}
        for rank, pair in enumerate(e.get("top") or (), start=1):
            if isinstance(pair, list | tuple) and len(pair) == 2 and isinstance(pair[0], int):
                d[str(pair[0])] = {
                    "logprob": clamp_logprob(pair[1]),
                    "rank": rank,
                    "decoded_token": token_text(pair[0]),
                }
        d[str(e["token_id"])] = {
            "logprob": clamp_logprob(e["logprob"]),
            "rank": e.get("rank"),
            "decoded_token": token_text(e["token_id"]),
        }
        out.append(d)
    return out


def echo_choice(
    choice_: dict,
    req: ParsedRequest,
    prompt_text: str,
    prompt_raw: list | None,
    token_text: TokenText,
) -> dict:
    """A ``text_completion`` choice (:func:`choice`) with ``req``'s OpenAI ``echo`` applied --
    the prompt text before the output (instead of it when ``req.echo_only``: ``max_tokens=0``),
    the prompt tokens' logprobs before the output's -- and vLLM's ``prompt_logprobs`` field.
    ``prompt_raw``: the engine's prompt entries (``Final.prompt_logprobs``). Unchanged when the
    request asked for neither."""
    echo_only = req.echo_only
    if req.echo:
        generated = "" if echo_only else choice_["text"]
        choice_["text"] = prompt_text + generated
        if req.logprobs is not None:
            merged = prompt_completion_logprobs(prompt_raw, token_text)
            if not echo_only and choice_.get("logprobs"):
                gen = choice_["logprobs"]
                shift = len(prompt_text)
                gen["text_offset"] = [o + shift for o in gen["text_offset"]]
                for key in merged:
                    merged[key].extend(gen[key])
            choice_["logprobs"] = merged
        if echo_only:
            choice_["finish_reason"] = "length"
    if req.prompt_logprobs is not None:
        choice_["prompt_logprobs"] = vllm_prompt_logprobs(prompt_raw, token_text)
    return choice_


def choice_logprobs(kind: str, raw: list | None, token_text: TokenText, offset: int = 0) -> dict:
    """``choice.logprobs`` for ``kind``: the chat form or the legacy form (from ``offset``)."""
    if kind == "chat":
        return chat_logprobs(raw, token_text)
    return completion_logprobs(raw, token_text, offset)


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """``usage`` in tokens (``prompt_tokens_details.cached_tokens``: prefix-cache hits)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(
    kind: str, index: int, text: str, finish_reason: str | None, logprobs: dict | None
) -> dict:
    """One choice of a whole (non-streamed) completion object."""
    content = (
        {"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text}
    )
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def service_tier(lane: str) -> str:
    """The ``service_tier`` a response reports, as OpenAI's echo the tier that served it:
    ``"flex"`` for the batch lane, ``"default"`` for the interactive one (what
    ``SERVICE_TIER_LANES`` maps the request's tier to)."""
    return "flex" if lane == "batch" else "default"


def completion_object(
    kind: str, rid: str, created: int, model: str, choices: list[dict], usage: dict,
    tier: str | None = None,
) -> dict:  # fmt: skip
    """A ``chat.completion`` / ``text_completion`` object (``created``: unix seconds; ``tier``:
    its ``service_tier``, left out when None)."""
    out = {
        "id": rid,
        "object": OBJECT[kind],
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    if tier is not None:
        out["service_tier"] = tier
    return out


def chunk(
    kind: str, rid: str, created: int, model: str, choices: list[dict], usage: Any = None,
    tier: str | None = None,
) -> dict:  # fmt: skip
    """One stream chunk (``chat.completion.chunk`` / ``text_completion``; ``tier``: its
    ``service_tier``, left out when None)."""
    out = {
        "id": rid,
        "object": CHUNK_OBJECT[kind],
        "created": created,
        "model": model,
        "choices": choices,
    }
    if tier is not None:
        out["service_tier"] = tier
    if usage is not None:
        out["usage"] = usage
    return out
