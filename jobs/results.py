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

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)


def submit_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """`BrokerClient.submit` keyword arguments (prompt form, sampling params, model) for a
    validated line request `{"url", "body"}` (see `jobs.validate.LineResult.request`)."""
    body = request["body"]
    sampling = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    kwargs: dict[str, Any] = {"sampling_params": sampling, "model": body.get("model")}
    if request["url"] == "/v1/chat/completions":
        kwargs["messages"] = body["messages"]
    elif isinstance(body["prompt"], list):
        kwargs["prompt_token_ids"] = body["prompt"]
    else:
        kwargs["prompt"] = body["prompt"]
    return kwargs


def usage(final: p.Final) -> dict[str, int]:
    prompt = int(final.usage.get("prompt_tokens") or 0)
    completion = int(final.usage.get("completion_tokens") or len(final.token_ids))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def success_response(
    rid: str, url: str, model: str | None, final: p.Final, extra: dict | None = None
) -> dict[str, Any]:
    """The stored `response` of a finished line: the OpenAI completion object as `body`.

    `extra` (e.g. `{"map_reduce": {...}}`) is added to the body under `"laneserve"`.
    """
    created = int(time.time())
    if url == "/v1/chat/completions":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": final.text},
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": final.text,
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
        obj = "text_completion"
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model or "",
        "choices": [choice],
        "usage": usage(final),
    }
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
