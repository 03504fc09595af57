"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

Flow of one request: arrival stamped before anything else (:mod:`laneserve.api.arrival`) ->
read the body (size limit) -> validate (:func:`laneserve.contracts.openai.parse`) -> check the model name
and count prompt tokens (:class:`laneserve.contracts.openai.ServedModel`) -> make sure a worker serves the
lane (else 503 at once, not after the broker's no-worker timeout) -> submit every choice
(:class:`~laneserve.api.generate.Generation`) -> respond with the objects of
:mod:`laneserve.contracts.openai.responses`.

Streams decide their HTTP status before the first SSE byte: the response starts only once every
choice has heard back from the broker (its first token, or an error such as ``overloaded`` ->
429). A client that disconnects -- before or during the stream, or while a non-streamed request
runs -- has its engine requests aborted.
"""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from laneserve.api.arrival import arrival
from laneserve.api.auth import read_json
from laneserve.api.errors import response_for
from laneserve.api.generate import DISCONNECTED, Choice, Event, Generation, race_disconnect
from laneserve.contracts.openai import responses as fmt
from laneserve.contracts.openai.requests import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, parse
from laneserve.contracts.openai.tool_parsers import ToolStream, apply_tools

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState
    from laneserve.contracts.openai.requests import ParsedRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chat_completions(request: Request) -> Response:
    return await _serve(request, CHAT_ENDPOINT)


async def completions(request: Request) -> Response:
    return await _serve(request, COMPLETIONS_ENDPOINT)


async def _serve(request: Request, endpoint: str) -> Response:
    arrival_monotonic, arrival_time = arrival(request.scope)
    state: GatewayState = request.app.state.gateway
    cfg = state.config
    body = await read_json(request, cfg.max_body_bytes)
    if type(body) is dict and any(
        k in body for k in ("response_format", "structured_outputs", "tools")
    ):
        # checking a large schema takes up to ~0.5 s: off the event loop
        req = await run_in_threadpool(parse, endpoint, body, cfg.limits)
    else:
        req = parse(endpoint, body, cfg.limits)
    kind = req.kind
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    gen = await checked_generation(
        state, req, prefix + uuid.uuid4().hex, (arrival_monotonic, arrival_time)
    )
    streamed = _chat_stream if kind == "chat" else _completion_stream
    return await respond(
        request, gen, req.stream, lambda: _body(gen, state), lambda: streamed(gen, state)
    )


async def checked_generation(
    state: GatewayState, req: ParsedRequest, request_id: str, arrived: tuple[float, float]
) -> Generation:
    """The model named, the prompts counted (``max_tokens`` settled) and a worker serving the
    lane checked, the (unstarted) generation of ``req``. ``arrived``: (monotonic, unix) s when
    the gateway accepted the request. Raises ApiError (404, 400, 503)."""
    await state.check_model(req.model)
    state.model_info.check(req, state.config.limits)
    await state.check_lane(req.lane)
    return Generation(
        state.client,
        req,
        request_id,
        arrival_monotonic=arrived[0],
        arrival_time=arrived[1],
        metrics=state.metrics,
    )


async def respond(
    request: Request,
    gen: Generation,
    stream: bool,
    whole: Callable[[], Any],
    streamed: Callable[[], AsyncIterator[bytes]],
) -> Response:
    """Start `gen` and answer with ``whole()`` (a dict, or awaited to one) once it has finished, or (``stream``) with the
    SSE body ``streamed()`` once every choice has started; errors before that are plain
    JSON errors. The generation is aborted however the response ends."""
    owned: Generation | None = gen
    gen.start()
    try:
        if not stream:
            if await race_disconnect(request.receive, gen.run_to_end()) is DISCONNECTED:
                return Response(status_code=499)  # nobody reads it; close() sends the aborts
            if gen.error is not None:
                return response_for(gen.error)
            obj = whole()
            if inspect.isawaitable(obj):
                obj = await obj
            response = Response(fmt.dumps(obj), media_type="application/json")
            gen.sent()
            return response
        if await race_disconnect(request.receive, gen.wait_started()) is DISCONNECTED:
            return Response(status_code=499)
        if gen.error is not None:
            return response_for(gen.error)
        response = _GenerationStream(gen, streamed())  # owns gen from here on
        owned = None
        return response
    finally:
        if owned is not None:
            owned.close()


class _GenerationStream(StreamingResponse):
    """An SSE response that aborts its generation however the response ends -- also when the
    client leaves before the body iterator ever started (its ``finally`` would not run)."""

    def __init__(self, gen: Generation, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


# ---------------------------------------------------------------------------- non-streamed


def _finish(reason: str | None) -> str:
    return reason or "stop"


def _body(gen: Generation, state: GatewayState) -> dict:
    """The whole ``chat.completion`` / ``text_completion`` object of a finished generation."""
    req = gen.req
    info = state.model_info
    choices = []
    for c in gen.choices:
        one = fmt.choice(
            req.kind,
            c.index,
            "".join(c.text),
            _finish(c.finish_reason),
            (
                fmt.choice_logprobs(req.kind, c.logprobs, info.token_text)
                if req.logprobs is not None
                else None
            ),
        )
        if req.tools is not None:
            apply_tools(one, req.tools, info.tool_parser)
        text = info.prompt_text(c.prompt) if req.echo else ""
        choices.append(fmt.echo_choice(one, req, text, c.prompt_logprobs, info.token_text))
    return fmt.completion_object(
        req.kind, gen.id, gen.created, req.model, choices, _usage(gen), fmt.service_tier(req.lane)
    )


def _usage(gen: Generation) -> dict:
    u = gen.usage()
    completion = 0 if gen.req.echo_only else u["completion_tokens"]  # the run token is dropped
    return fmt.usage_object(u["prompt_tokens"], completion, u["cached_tokens"])


# ---------------------------------------------------------------------------- streamed


async def events(gen: Generation) -> AsyncIterator[list[Event]]:
    """The backlog, then batches of events: one awaited plus whatever is already queued."""
    if gen.backlog:
        batch, gen.backlog = gen.backlog, []
        yield batch
    while not gen.finished:
        batch = [await gen.next_event()]
        while not gen.finished and not gen._queue.empty():
            batch.append(await gen.next_event())
        yield batch


def _error_tail(gen: Generation) -> bytes:
    assert gen.error is not None
    return fmt.sse(gen.error.body()) + fmt.SSE_DONE


async def _sse_stream(
    gen: Generation,
    chunk: Callable[..., dict],
    body: Callable[[Choice, str | None], list[dict]],
    logprobs: Callable[[Any], dict | None],
    opening: list[bytes],
    close: Callable[[Choice], tuple[list[dict], str]] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body shared by chat and text completions.

    Args:
        chunk: ``chunk(choices, usage=None)`` -> one ``chat.completion.chunk`` / ``text_completion``.
        body: a choice's content fields for a piece of text, e.g. ``[{"delta": {"content":
            text}}]`` or ``[{"text": text}]`` (none while a tool call is held back; ``None``
            text: the closing chunk's empty fields).
        logprobs: the choice's ``logprobs`` for one event, or None.
        opening: chunks sent before any token (the chat role deltas).
        close: a choice's last content fields and its ``finish_reason`` (tool calls held back
            until the end); default none and the engine's reason.
    """
    try:
        out = list(opening)
        async for batch in events(gen):
            for ev in batch:
                c = ev.choice
                if c.error is not None:
                    yield b"".join(out) + _error_tail(gen)
                    return
                lp = logprobs(ev)
                if ev.text or lp:
                    parts = body(c, ev.text) or ([{"delta": {}}] if lp else [])
                    for k, part in enumerate(parts):
                        choice = {"index": c.index, **part, "logprobs": None if k else lp}
                        out.append(fmt.sse(chunk([{**choice, "finish_reason": None}])))
                if ev.final:
                    parts, reason = close(c) if close else ([], _finish(c.finish_reason))
                    for part in parts:
                        choice = {"index": c.index, **part, "logprobs": None}
                        out.append(fmt.sse(chunk([{**choice, "finish_reason": None}])))
                    (end,) = body(c, None)
                    choice = {"index": c.index, **end, "logprobs": None, "finish_reason": reason}
                    out.append(fmt.sse(chunk([choice])))
            if out:
                gen.mark_sent((ev.choice for ev in batch), time.monotonic())
                yield b"".join(out)
                out = []
        if gen.req.include_usage:
            out.append(fmt.sse(chunk([], usage=_usage(gen))))
        out.append(fmt.SSE_DONE)
        yield b"".join(out)
        gen.report(time.monotonic())  # runs once the server has taken the last bytes
    finally:
        gen.close()


def _chat_stream(gen: Generation, state: GatewayState) -> AsyncIterator[bytes]:
    req, info = gen.req, state.model_info
    want_lp = req.logprobs is not None
    tier = fmt.service_tier(req.lane)
    tools = req.tools if req.tools is not None and req.tools.choice != "none" else None
    calls = {c.index: ToolStream(tools, info.tool_parser) for c in gen.choices} if tools else {}

    def chunk(choices: list[dict], **kw) -> dict:
        return fmt.chunk("chat", gen.id, gen.created, req.model, choices, tier=tier, **kw)

    def body(c: Choice, text: str | None) -> list[dict]:
        if text is None:
            return [{"delta": {}}]
        if calls:
            return [{"delta": d} for d in calls[c.index].feed(text)]
        return [{"delta": {"content": text}}]

    def close(c: Choice) -> tuple[list[dict], str]:
        deltas, reason = calls[c.index].close(_finish(c.finish_reason))
        return [{"delta": d} for d in deltas], reason

    def logprobs(ev) -> dict | None:
        return fmt.chat_logprobs(ev.logprobs, info.token_text) if want_lp and ev.logprobs else None

    role = {"role": "assistant", "content": ""}
    opening = [
        fmt.sse(chunk([{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}]))
        for c in gen.choices
    ]
    return _sse_stream(gen, chunk, body, logprobs, opening, close if calls else None)


def _completion_stream(gen: Generation, state: GatewayState) -> AsyncIterator[bytes]:
    req, info = gen.req, state.model_info
    want_lp = req.logprobs is not None
    offsets: dict[int, int] = {}  # text offset of each choice, for the legacy logprobs
    tier = fmt.service_tier(req.lane)

    def chunk(choices: list[dict], **kw) -> dict:
        return fmt.chunk("completion", gen.id, gen.created, req.model, choices, tier=tier, **kw)

    def body(_c: Choice, text: str | None) -> list[dict]:
        return [{"text": text or ""}]

    def logprobs(ev) -> dict | None:
        if not (want_lp and ev.logprobs):
            return None
        index = ev.choice.index
        lp = fmt.completion_logprobs(ev.logprobs, info.token_text, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + sum(map(len, lp["tokens"]))
        return lp

    return _sse_stream(gen, chunk, body, logprobs, [])


__all__ = ["chat_completions", "completions", "events", "respond"]
