"""``POST /v1/responses``: OpenAI's Responses API on the chat engine path.

The body is translated to a chat-completions body (:mod:`laneserve.contracts.openai.responses_api`)
and validated by the chat parser, so limits, structured outputs and tool calling are chat's. The
reply is one chat choice, read for tool calls as chat reads it, and answered as a ``response``
object whose ``output`` holds a ``message`` item and/or ``function_call`` items.

Streamed (``stream: true``), the events are OpenAI's, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
(text) ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done`` / (call)
``response.function_call_arguments.delta``, ``response.function_call_arguments.done``, then
``response.output_item.done``, and last ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it; an ``error`` event when the engine failed). Text without tools
streams token by token; with tools the reply is held until it is known to be a call or text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

import laneserve.api.response_background as background
import laneserve.api.response_store as store
from laneserve.api.arrival import arrival
from laneserve.api.auth import read_json
from laneserve.api.completions import checked_generation, events, respond
from laneserve.api.errors import ApiError
from laneserve.api.generate import Generation
from laneserve.contracts.openai import responses as fmt
from laneserve.contracts.openai import responses_api as api
from laneserve.contracts.openai.tool_parsers import apply_tools

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState


async def create_response(request: Request) -> Response:
    arrival_monotonic, arrival_time = arrival(request.scope)
    state: GatewayState = request.app.state.gateway
    cfg = state.config
    body = await read_json(request, cfg.max_body_bytes)
    prior: list[dict] = []
    if type(body) is dict and body.get("previous_response_id") is not None:
        prior = await store.history(request, state, body["previous_response_id"])
    req = await run_in_threadpool(api.parse_response_request, body, cfg.limits, prior)
    gen = await checked_generation(
        state, req, api.new_id("resp"), (arrival_monotonic, arrival_time)
    )
    keep = store.can_store(body, state)
    if body.get("background") is True:
        if not keep:
            raise ApiError("database_unavailable", "background responses need the database")
        items = [*prior, *api.input_items(body)]
        run = background.Running(gen, None, store.owner_of(request), items, body, arrival_time)
        return await background.start(state, run, background_result(state, body, arrival_time))

    async def finished(output: list[dict], status: str) -> dict:
        usage = _usage(gen)
        obj = api.response_object(gen.id, arrival_time, body, output, status, usage, keep)
        if keep:
            obj["store"] = await store.save(request, state, [*prior, *api.input_items(body)], obj)
        return obj

    async def whole() -> dict:
        return await finished(*_result(gen, state))

    stream = body.get("stream") is True
    return await respond(
        request, gen, stream, whole, lambda: _stream(gen, state, body, arrival_time, finished)
    )


def background_result(
    state: GatewayState, body: dict, created: float
) -> Callable[[Generation], Awaitable[dict]]:
    """The final (stored) object of a finished background response made from ``body`` at
    ``created`` (unix s)."""

    async def done(gen: Generation) -> dict:
        output, status = _result(gen, state)
        return api.response_object(gen.id, created, body, output, status, _usage(gen), True)

    return done


def _result(gen: Generation, state: GatewayState) -> tuple[list[dict], str]:
    """The output items of the finished (single) choice and the response's status."""
    (c,) = gen.choices
    reason = c.finish_reason or "stop"
    one = fmt.choice("chat", 0, "".join(c.text), reason, None)
    if gen.req.tools is not None:
        apply_tools(one, gen.req.tools, state.model_info.tool_parser)
    status = "incomplete" if reason == "length" else "completed"
    return api.output_items(one["message"], status), status


def _usage(gen: Generation) -> dict:
    u = gen.usage()
    return api.usage(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"])


class _Events:
    """Numbered SSE events (``event: <type>`` and the JSON with ``type`` and ``sequence_number``)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\n".encode() + fmt.sse(data)


def _item_events(ev: _Events, index: int, item: dict, live: bool = False) -> list[bytes]:
    """A whole output item's events; with ``live`` only its opening ones (text follows)."""
    status = item["status"]
    opened = {**item, "status": "in_progress"}
    if item["type"] == "function_call":
        args = item["arguments"]
        opened["arguments"] = ""
        where = {"item_id": item["id"], "output_index": index}
        return [
            ev("response.output_item.added", output_index=index, item=opened),
            ev("response.function_call_arguments.delta", **where, delta=args),
            ev("response.function_call_arguments.done", **where, name=item["name"], arguments=args),
            ev("response.output_item.done", output_index=index, item=item),
        ]
    opened["content"] = []
    out = [
        ev("response.output_item.added", output_index=index, item=opened),
        ev("response.content_part.added", **_part_at(item, index), part=api.text_part("")),
    ]
    if live:
        return out
    text = item["content"][0]["text"] if item["content"] else ""
    out.append(ev("response.output_text.delta", **_part_at(item, index), delta=text, logprobs=[]))
    return out + _text_done(ev, index, item["id"], text, status)


def _part_at(item: dict, index: int) -> dict:
    return {"item_id": item["id"], "output_index": index, "content_index": 0}


def _text_done(ev: _Events, index: int, item_id: str, text: str, status: str) -> list[bytes]:
    at = {"item_id": item_id, "output_index": index, "content_index": 0}
    item = api.message_item(item_id, text, status)
    return [
        ev("response.output_text.done", **at, text=text, logprobs=[]),
        ev("response.content_part.done", **at, part=api.text_part(text)),
        ev("response.output_item.done", output_index=index, item=item),
    ]


async def _stream(
    gen: Generation,
    state: GatewayState,
    body: dict,
    created: float,
    finished: Callable[[list[dict], str], Awaitable[dict]],
) -> AsyncIterator[bytes]:
    ev = _Events()
    live = gen.req.tools is None or gen.req.tools.choice == "none"
    item_id = api.new_id("msg")
    start = api.response_object(gen.id, created, body, [], "in_progress", None)
    out = [ev("response.created", response=start), ev("response.in_progress", response=start)]
    if live:
        out += _item_events(ev, 0, api.message_item(item_id, None, "in_progress"), live=True)
    try:
        async for batch in events(gen):
            for e in batch:
                if e.choice.error is not None:
                    err = e.choice.error
                    yield b"".join(out) + ev(
                        "error", code=err.code, message=err.message, param=None
                    )
                    return
                if live and e.text:
                    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
                    out.append(ev("response.output_text.delta", **at, delta=e.text, logprobs=[]))
            if out:
                gen.mark_sent((e.choice for e in batch), time.monotonic())
                yield b"".join(out)
                out = []
        output, status = _result(gen, state)
        if live:
            text = "".join(gen.choices[0].text)
            output = [api.message_item(item_id, text, status)]
            out += _text_done(ev, 0, item_id, text, status)
        else:
            for i, item in enumerate(output):
                out += _item_events(ev, i, item)
        done = await finished(output, status)
        out.append(ev(f"response.{status}", response=done))
        yield b"".join(out)
        gen.report(time.monotonic())
    finally:
        gen.close()


__all__ = ["background_result", "create_response"]
