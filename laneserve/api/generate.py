"""One HTTP completion request -> one engine request per choice, through the broker.

``n > 1`` and lists of prompts fan out (DESIGN.md "The gateway fans out n > 1 as n requests"):
choice ``k`` (``k = prompt_index * n + sample``) is the broker request ``{id}`` for ``k == 0``
and ``{id}-{k}`` otherwise, so the response ``id`` is byte-equal to the ``requests.id`` of its
first choice. With a ``seed`` and ``n > 1``, sample ``j`` uses ``seed + j`` (distinct but
reproducible samples).

Arrival is the moment the gateway accepted the HTTP request, before the body was read
(:mod:`laneserve.api.arrival`). TTFT (DESIGN.md: arrival -> the first content token leaves the
edge) is stamped when the bytes carrying a choice's first content are handed to the server
(:meth:`Generation.mark_sent`: a stream's chunk, or a non-streamed response's whole body, which
is when its first token reaches the client); e2e when the last bytes are
(:meth:`Generation.report`). The edge's TTFT and e2e replace the broker's in SQL
(``report_edge_timings``) and feed ``/metrics``.

Every choice is submitted with ``stream=True`` even when the HTTP response is not streamed, so
the gateway sees each token arrive and measures TTFT and inter-token gaps at the edge for all
requests. A choice of a non-streaming response is ``restartable``: after a broker restart or a
lost worker it runs again from the start (the client yields a ``Restart``; its output so far is
dropped) instead of failing. The broker's ``arrival`` is extended back to the gateway's arrival through
``arrival_monotonic`` (the Submit's ``edge_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from laneserve.api.errors import STATUS_BY_CODE, ApiError
from laneserve.api.metrics import GatewayMetrics
from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient, Restart
from laneserve.contracts import latency

if TYPE_CHECKING:
    from laneserve.contracts.openai.requests import ParsedRequest, Prompt

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Choice:
    """What one engine request produced so far."""

    index: int
    request_id: str
    prompt: Prompt
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # the engine's prompt entries (from the Final)
    embedding: bytes | None = None  # an embedding request's vector (float32 bytes, the Final)
    num_tokens: int = 0
    started: bool = False  # the broker said something about it (delta, final or error)
    done: bool = False
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    error: ApiError | None = None
    first_token_t: float = 0.0  # monotonic s of the first content delta at the gateway
    last_token_t: float = 0.0
    first_sent_t: float = 0.0  # monotonic s its first content was handed to the server
    reported: bool = False  # edge timings sent to the broker


@dataclass(slots=True)
class Event:
    """One broker message applied to a choice: new ``text``/``logprobs``; ``final`` when the
    choice ended (``choice.finish_reason`` or ``choice.error`` set)."""

    choice: Choice
    text: str = ""
    logprobs: list | None = None
    final: bool = False


class Generation:
    """Submits the choices of ``req`` and merges their broker streams into :class:`Event` s."""

    def __init__(
        self,
        client: BrokerClient,
        req: ParsedRequest,
        request_id: str,
        *,
        arrival_monotonic: float,
        arrival_time: float,
        metrics: GatewayMetrics,
    ) -> None:
        self.client = client
        self.req = req
        self.id = request_id
        self.arrival_monotonic = arrival_monotonic
        self.arrival_time = arrival_time
        self.metrics = metrics
        self.created = int(arrival_time)
        self.choices = [
            Choice(
                index=i * req.n + j,
                request_id=request_id if i * req.n + j == 0 else f"{request_id}-{i * req.n + j}",
                prompt=prompt,
            )
            for i, prompt in enumerate(req.prompts)
            for j in range(req.n)
        ]
        self._queue: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.backlog: list[Event] = []  # events consumed by wait_started(), not yet streamed
        self.error: ApiError | None = None
        self._open = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Submit every choice. Raises ApiError (400) if the broker client refuses one."""
        req = self.req
        for choice, request in zip(self.choices, req.engine_requests(self.id), strict=True):
            assert request.request_id == choice.request_id, "choices in vLLM's order"
            try:
                stream = self.client.submit_request(
                    request,
                    stream=True,
                    model=req.model,
                    arrival_time=self.arrival_time,
                    arrival_monotonic=self.arrival_monotonic,
                    restartable=not req.stream,
                )
            except p.ProtocolError as exc:
                self.close()
                raise ApiError("invalid_request", str(exc)) from exc
            self._tasks.append(asyncio.create_task(self._pump(choice, stream)))
            self._open += 1

    def close(self) -> None:
        """Abort every unfinished choice (the broker forwards the aborts to the workers)."""
        for task in self._tasks:
            task.cancel()

    async def _pump(self, choice: Choice, stream: AsyncIterator[Any]) -> None:
        try:
            async for msg in stream:
                self._queue.put_nowait((choice, msg))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not the client's fault: end this choice with a 500
            logger.exception("broker stream of %s failed", choice.request_id)
            self._queue.put_nowait(
                (choice, p.Error(request_id=choice.request_id, code="internal", message=str(exc)))
            )
        finally:
            # Leaving early closes the broker iterator, which sends the abort.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    # ------------------------------------------------------------------ consuming

    @property
    def finished(self) -> bool:
        return self._open == 0

    async def next_event(self) -> Event:
        """The next broker message, applied to its choice. Call only while not ``finished``."""
        choice, msg = await self._queue.get()
        return self._apply(choice, msg, time.monotonic())

    async def wait_started(self) -> None:
        """Consume events (kept in ``backlog``) until every choice has started or one failed."""
        while not all(c.started for c in self.choices) and not self.finished:
            ev = await self.next_event()
            self.backlog.append(ev)
            if self.error is not None:
                return

    async def run_to_end(self) -> None:
        """Consume everything (non-streaming responses); stops at the first error."""
        while not self.finished:
            await self.next_event()
            if self.error is not None:
                return

    def _apply(self, choice: Choice, msg: Any, now: float) -> Event:
        choice.started = True
        lane = self.req.lane
        kind = type(msg)
        if kind is p.Delta:
            self._on_tokens(choice, msg.text, msg.token_ids, msg.logprobs, now)
            return Event(choice, msg.text, msg.logprobs)
        if kind is Restart:  # never for a streamed response: nothing was sent yet
            choice.text.clear()
            choice.logprobs.clear()
            choice.num_tokens = 0
            return Event(choice)
        self._open -= 1
        choice.done = True
        if kind is p.Final:
            tail = msg.text
            tail_lp = msg.logprobs
            if tail or msg.token_ids:
                self._on_tokens(choice, tail, msg.token_ids, tail_lp, now)
            choice.usage = dict(msg.usage)
            choice.timings = dict(msg.timings)
            choice.prompt_logprobs = msg.prompt_logprobs
            choice.embedding = msg.embedding
            if msg.finish_reason in ("stop", "length"):
                choice.finish_reason = msg.finish_reason
                self.metrics.observe_final(lane, choice.timings, choice.usage, msg.finish_reason)
                return Event(choice, tail, tail_lp, final=True)
            code, why = (
                ("worker_lost", "the request was aborted by the server; retry")
                if msg.finish_reason == "abort"
                else ("engine_error", "the engine failed on this request")
            )
            choice.error = ApiError(code, why)
        else:  # p.Error
            code = msg.code if msg.code in STATUS_BY_CODE else "internal"
            choice.error = ApiError(code, msg.message or code)
        self.metrics.failure.labels(lane, choice.error.code).inc()
        if self.error is None:
            self.error = choice.error
        return Event(choice, final=True)

    def _on_tokens(
        self, choice: Choice, text: str, token_ids: list, logprobs: list | None, now: float
    ) -> None:
        choice.num_tokens += len(token_ids)
        if logprobs:
            choice.logprobs.extend(logprobs)
        if not text:
            return
        choice.text.append(text)
        lane = self.req.lane
        if not choice.first_token_t:
            choice.first_token_t = now
        else:
            self.metrics.itl.labels(lane).observe(now - choice.last_token_t)
        choice.last_token_t = now

    def mark_sent(self, choices: Iterable[Choice], now: float) -> None:
        """The bytes carrying ``choices``' text so far are handed to the server at ``now``
        (monotonic s): the first content token of each that had text leaves the edge."""
        for choice in choices:
            if choice.text and not choice.first_sent_t:
                choice.first_sent_t = now

    def report(self, now: float) -> None:
        """The response's last bytes were handed to the server at ``now``: observe and report
        TTFT and e2e of every choice that finished normally (once each)."""
        for choice in self.choices:
            if choice.finish_reason is not None and not choice.reported:
                choice.reported = True
                self._observe_end(choice, now)

    def sent(self) -> None:
        """A non-streamed response's whole body is being handed to the server now. Its TTFT
        ends when each choice's first content token reached the edge (as vLLM records it for
        a non-streamed request), not with the body: e2e covers the wait for the last token."""
        now = time.monotonic()
        for choice in self.choices:
            if choice.text and not choice.first_sent_t:
                choice.first_sent_t = choice.first_token_t or now
        self.report(now)

    def _observe_end(self, choice: Choice, now: float) -> None:
        lane = self.req.lane
        # DESIGN: TTFT and e2e are measured at the edge (arrival = this gateway accepting the
        # HTTP request); the broker stores these in SQL. Prometheus histograms take seconds.
        e2e_ms = latency.e2e_ms(0.0, latency.interval_ms(self.arrival_monotonic, now))
        ttft_ms = latency.ttft_ms(
            0.0, latency.interval_ms(self.arrival_monotonic, choice.first_sent_t or None)
        )
        self.metrics.e2e.labels(lane).observe(e2e_ms / 1000.0)
        if ttft_ms is not None:
            self.metrics.ttft.labels(lane).observe(ttft_ms / 1000.0)
        self.client.report_edge_timings(choice.request_id, ttft_ms, e2e_ms)

    # ------------------------------------------------------------------ results

    def usage(self) -> dict[str, int]:
        """Token totals: prompt and cached tokens once per prompt (sample 0 of each prompt, as
        OpenAI and vLLM count ``n > 1``), completion tokens over every choice."""
        prompt = cached = completion = 0
        for c in self.choices:
            completion += _int(c.usage.get("completion_tokens"), c.num_tokens)
            if c.index % self.req.n == 0:
                prompt += _int(c.usage.get("prompt_tokens"), c.prompt.num_tokens or 0)
                cached += _int(c.usage.get("cached_tokens"), 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}


def _int(value: Any, default: int) -> int:
    return value if type(value) is int else default


DISCONNECTED = object()


async def until_disconnect(receive: Any) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect`` (call only after the
    request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Any, coro: Any) -> Any:
    """Await ``coro`` unless the client disconnects first; then cancel it and return
    :data:`DISCONNECTED`."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return DISCONNECTED
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
