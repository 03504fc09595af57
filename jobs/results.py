"""Request and result shapes of job lines: broker submit arguments in, OpenAI batch output out.

A finished line stores in `requests.response` either

- success: `{"status_code": 200, "request_id": <requests.id>, "body": <chat.completion or
  text_completion object>}` (the OpenAI batch output line's `response`), or
- failure: `{"error": {"code", "message"[, "attempts"]}}`,

and the output/error file line is composed from the row (`output_line`):
`{"id", "custom_id", "response", "error"}`, the OpenAI batch output format
(https://platform.openai.com/docs/guides/batch), `custom_id` always present (`line-N` when the
input line had none).
"""

from __future__ import annotations

import time
from typing import Any

from broker import protocol as p
from contracts.openai import Limits, parse
from contracts.openai import responses as fmt
from contracts.openai.responses import TokenText


def submit_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """`BrokerClient.submit` keyword arguments (prompt form, sampling params, model, priority)
    for a line request `{"url", "body"[, "sampling_params"]}` (`jobs.validate.LineResult`).

    The sampling params are the validated ones stored with the line; a request without them (a
    map-reduce piece, a line stored by an older validator) is mapped by the same parser.
    Raises `contracts.openai.OpenAIError` for a body that parser refuses.
    """
    body = request["body"]
    req = parse(request["url"], body, Limits())
    sampling = request.get("sampling_params")
    if sampling is None:
        sampling = dict(req.sampling)
        if req.max_tokens is not None:
            sampling["max_tokens"] = req.max_tokens
    prompt = req.prompts[0]
    kwargs: dict[str, Any] = {
        "sampling_params": sampling,
        "model": req.model,
        "priority": req.priority,
    }
    if prompt.messages is not None:
        kwargs["messages"] = prompt.messages
    elif prompt.token_ids is not None:
        kwargs["prompt_token_ids"] = prompt.token_ids
    else:
        kwargs["prompt"] = prompt.text
    return kwargs


def usage(final: p.Final) -> dict[str, Any]:
    """The completion's `usage` (tokens), as the gateway reports it."""
    return fmt.usage_object(
        int(final.usage.get("prompt_tokens") or 0),
        int(final.usage.get("completion_tokens") or len(final.token_ids)),
        int(final.usage.get("cached_tokens") or 0),
    )


def success_response(
    rid: str,
    url: str,
    model: str | None,
    final: p.Final,
    extra: dict | None = None,
    *,
    token_text: TokenText | None = None,
) -> dict[str, Any]:
    """The stored `response` of a finished line: the OpenAI completion object as `body`.

    With `token_text` (the line asked for logprobs) the choice carries `logprobs` in the
    endpoint's form, built from the engine's entries in `final.logprobs`. `extra` (e.g.
    `{"map_reduce": {...}}`) is added to the body under `"laneserve"`.
    """
    kind = "chat" if url == "/v1/chat/completions" else "completion"
    logprobs = None
    if token_text is not None:
        logprobs = fmt.choice_logprobs(kind, final.logprobs, token_text)
    choice = fmt.choice(kind, 0, final.text, final.finish_reason, logprobs)
    body = fmt.completion_object(kind, rid, int(time.time()), model or "", [choice], usage(final))
    if extra:
        body["laneserve"] = extra
    return {"status_code": 200, "request_id": rid, "body": body}


def error_response(code: str, message: str, attempts: int | None = None) -> dict[str, Any]:
    """The stored `response` of a failed line."""
    error: dict[str, Any] = {"code": code, "message": message}
    if attempts is not None:
        error["attempts"] = attempts
    return {"error": error}


def is_error(response: dict[str, Any]) -> bool:
    return "error" in response


def output_line(rid: str, custom_id: str, response: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI batch output/error file line for a finished row."""
    if is_error(response):
        return {"id": rid, "custom_id": custom_id, "response": None, "error": response["error"]}
    return {"id": rid, "custom_id": custom_id, "response": response, "error": None}
