"""Request and result shapes of job lines: broker submit arguments in, OpenAI batch output out.

A finished line stores in `requests.response` either

- success: `{"status_code": 200, "request_id": <requests.id>, "body": <chat.completion or
  text_completion object>}` (the OpenAI batch output line's `response`), or
- failure: `{"error": {"code", "message"[, "param"][, "attempts"]}}` (`param`: the line's field
  at fault, where validation knows it),

and the output/error file line is composed from the row (`output_line`):
`{"id", "custom_id", "response", "error"}`, the OpenAI batch output format. A chat line constrained
to JSON (`response_format` json_object / json_schema, the `extract` task) also carries the parsed
value as `message.parsed` (null when it stopped early), as the openai SDK's `parse()` names it
(https://platform.openai.com/docs/guides/batch), `custom_id` always present (`line-N` when the
input line had none).
"""

from __future__ import annotations

import time
from typing import Any

from laneserve.broker import protocol as p
from laneserve.contracts.engine_io import EngineRequest, TextRequest
from laneserve.contracts.openai import Limits, ServedModel, parse, responses_api
from laneserve.contracts.openai import responses as fmt
from laneserve.contracts.openai.embeddings import (
    EMBEDDINGS_ENDPOINT,
    embeddings_response,
    encoding_format,
)
from laneserve.contracts.openai.responses import TokenText
from laneserve.contracts.openai.structured import parsed_json, wants_json
from laneserve.contracts.openai.tool_parsers import apply_tools


def choice_requests(
    rid: str, request: dict[str, Any]
) -> tuple[str, list[EngineRequest | TextRequest]]:
    """The model and one batch-lane `EngineRequest` per choice of a line request
    `{"url", "body"[, "sampling_params"][, "prompt_token_ids"]}`
    (`jobs.validate.LineResult.request`); the validator's `prompt_token_ids` (one list per
    prompt) are sent instead of the text, so a line is tokenized once (a `TextRequest` when
    the validator had no tokenizer: the worker's front end tokenizes it).

    A line fans out as the gateway does (`ParsedRequest.engine_requests`): choice `k = prompt *
    n + sample` is the line's own request id for `k == 0` and `{rid}-{k}` otherwise, with
    `ParsedRequest.sampling_for(k)` (`seed + sample`). The sampling params are the validated
    ones stored with the line; a request without them (a map-reduce piece, a line stored by an
    older validator) is mapped by the same parser. Raises `contracts.openai.OpenAIError` for a
    body that parser refuses.
    """
    req = parse(request["url"], request["body"], Limits())
    stored = request.get("sampling_params")
    if stored is not None:
        req.sampling = dict(stored)
    elif req.max_tokens is not None:
        req.sampling["max_tokens"] = req.max_tokens
    encoded = request.get("prompt_token_ids")  # the validator's ids, when it tokenized
    if encoded is not None and len(encoded) == len(req.prompts):
        for prompt, ids in zip(req.prompts, encoded, strict=True):
            prompt.encoded = ids
    return req.model, req.engine_requests(rid, lane="batch")


def _response_line(rid: str, final: p.Final, body: dict, served: ServedModel) -> dict[str, Any]:
    """A /v1/responses line's stored response: the Responses object (not stored: ``store``
    false), its output items as the API builds them, ``id`` the line's request id."""
    req = parse("/v1/responses", body, Limits())
    one = fmt.choice("chat", 0, final.text, final.finish_reason, None)
    if req.tools is not None:
        apply_tools(one, req.tools, served.tool_parser)
    status = "incomplete" if final.finish_reason == "length" else "completed"
    u = usage([final])
    totals = responses_api.usage(
        u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    )
    output = responses_api.output_items(one["message"], status)
    obj = responses_api.response_object(rid, int(time.time()), body, output, status, totals)
    return {"status_code": 200, "request_id": rid, "body": obj}


def usage(finals: list[p.Final], n: int = 1) -> dict[str, Any]:
    """The completion's `usage` (tokens), as the gateway counts it: prompt and cached tokens
    once per prompt (sample 0 of each), completion tokens over every choice."""
    prompt = cached = completion = 0
    for k, final in enumerate(finals):
        completion += int(final.usage.get("completion_tokens") or len(final.token_ids))
        if k % n == 0:
            prompt += int(final.usage.get("prompt_tokens") or 0)
            cached += int(final.usage.get("cached_tokens") or 0)
    return fmt.usage_object(prompt, completion, cached)


def success_response(
    rid: str,
    url: str,
    model: str | None,
    final: p.Final | list[p.Final],
    extra: dict | None = None,
    *,
    n: int = 1,
    token_text: TokenText | None = None,
    body: dict | None = None,
    served: ServedModel | None = None,
) -> dict[str, Any]:
    """The stored `response` of a finished line: the OpenAI completion object as `body`, one
    choice per `Final` (choice `k` of `choice_requests`; `n` samples per prompt).

    With `token_text` (the line asked for logprobs) each choice carries `logprobs` in the
    endpoint's form, built from the engine's entries in `final.logprobs`. `extra` (e.g.
    `{"map_reduce": {...}}`) is added to the body under `"laneserve"`. `body` (the line's
    request body) applies `echo` / `prompt_logprobs` as the API does; `served` decodes token-id
    prompts for `echo`.
    """
    finals = final if isinstance(final, list) else [final]
    if url == EMBEDDINGS_ENDPOINT:
        fmt_ = encoding_format(body or {})
        vectors = [f.embedding or b"" for f in finals]
        prompt = sum(int(f.usage.get("prompt_tokens") or 0) for f in finals)
        out = embeddings_response(model or "", vectors, fmt_, prompt)
        return {"status_code": 200, "request_id": rid, "body": out}
    if url == "/v1/responses":
        return _response_line(rid, finals[0], body or {}, served or ServedModel())
    kind = "chat" if url == "/v1/chat/completions" else "completion"
    served = served or ServedModel()
    req = None
    if body is not None and (
        (kind == "completion" and (body.get("echo") or "prompt_logprobs" in body))
        or (kind == "chat" and body.get("tools"))
    ):
        req = parse(url, body, Limits())  # validated before it ran: echo's flags, the tools
    choices = []
    for k, f in enumerate(finals):
        logprobs = None if token_text is None else fmt.choice_logprobs(kind, f.logprobs, token_text)
        one = fmt.choice(kind, k, f.text, f.finish_reason, logprobs)
        if kind == "chat" and body is not None and wants_json(body):
            one["message"]["parsed"] = parsed_json(f.text, f.finish_reason)
        if req is not None and req.tools is not None:
            apply_tools(one, req.tools, served.tool_parser)
        elif req is not None and k // n < len(req.prompts):
            text = served.prompt_text(req.prompts[k // n]) if req.echo else ""
            one = fmt.echo_choice(
                one, req, text, f.prompt_logprobs, token_text or served.token_text
            )
        choices.append(one)
    totals = usage(finals, n)
    if req is not None and req.echo_only:  # the one token run is not part of the answer
        totals = fmt.usage_object(
            totals["prompt_tokens"], 0, totals["prompt_tokens_details"]["cached_tokens"]
        )
    tier = fmt.service_tier("batch")  # a job's lines run in the batch lane
    out = fmt.completion_object(kind, rid, int(time.time()), model or "", choices, totals, tier)
    if extra:
        out["laneserve"] = extra
    return {"status_code": 200, "request_id": rid, "body": out}


def error_response(
    code: str, message: str, attempts: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """The stored `response` of a failed line (`param`: the line's field at fault, if known)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if param is not None:
        error["param"] = param
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
