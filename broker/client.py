"""Broker clients: :class:`BrokerClient` (asyncio) and :func:`broker_status` (sync, for the CLI).

Usage::

    async with BrokerClient("ipc:///.../broker-front.sock") as client:
        async for msg in client.submit(prompt="Hi", lane="interactive",
                                       sampling_params={"max_tokens": 16}):
            if isinstance(msg, Delta): print(msg.text, end="")
            else: print(msg)            # the last item: a Final or an Error

``submit`` returns an async iterator of :class:`~broker.protocol.Delta` messages ending with one
:class:`~broker.protocol.Final` or :class:`~broker.protocol.Error`; errors are yielded, not
raised, so a caller sees the broker's code (``overloaded``, ``worker_lost``, ...). Leaving the
iteration early (``break``, task cancellation, ``aclose()``) sends an ``abort``.

Broker restarts: the client sends ``hello`` every ``heartbeat_interval_s`` while it has requests in
flight; the broker answers with its epoch. A changed epoch, or silence for ``liveness_s``, ends
every in-flight request with a retryable ``worker_lost`` error (the new broker does not know
them). The ZMQ DEALER reconnects by itself, so later submits go to the new broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio

from broker import protocol as p

logger = logging.getLogger(__name__)

Result = p.Delta | p.Final | p.Error


class BrokerClient:
    """Asyncio client of the broker's front socket. One instance per event loop."""

    def __init__(
        self,
        address: str,
        *,
        heartbeat_interval_s: float = 1.0,
        liveness_s: float = 10.0,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness_s = liveness_s
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.client_id = uuid.uuid4().hex[:12]
        self.epoch: str | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, asyncio.Queue[Result]] = {}
        self._status_waiters: dict[str, asyncio.Future[p.StatusReply]] = {}
        self._tasks: list[asyncio.Task] = []
        self._last_heard = 0.0
        self.invalid_messages = 0

    async def __aenter__(self) -> BrokerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and start the reader and heartbeat tasks."""
        if self._sock is not None:
            return
        sock = self.ctx.socket(zmq.DEALER)
        p.secure_socket_options(sock)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.connect(self.address)
        self._sock = sock
        self._last_heard = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._reader(), name="broker-client-reader"),
            asyncio.create_task(self._heartbeat(), name="broker-client-heartbeat"),
        ]
        self._send_nowait(p.Hello(client_id=self.client_id))  # learn the broker epoch

    async def close(self) -> None:
        """Abort what is in flight (best effort) and close the socket."""
        for rid in list(self._streams):
            self._send_nowait(p.Abort(request_id=rid))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=100)
            self._sock = None

    # ------------------------------------------------------------------ API

    def submit(
        self,
        *,
        lane: str = "interactive",
        prompt: str | None = None,
        messages: list[dict] | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: dict | None = None,
        stream: bool = True,
        request_id: str | None = None,
        priority: int = 0,
        model: str | None = None,
        arrival_time: float | None = None,
        arrival_monotonic: float | None = None,
        job_id: str | None = None,
        custom_id: str | None = None,
    ) -> RequestStream:
        """Send a request; returns an async iterator of Delta ... then one Final or Error.

        ``arrival_time`` (unix s) and ``arrival_monotonic`` (``time.monotonic()`` s) are when the
        edge accepted the request (default: now). Raises ProtocolError at once on an invalid
        request (bad lane, not exactly one prompt form, unknown sampling field, ...).
        """
        now = time.monotonic()
        msg = p.Submit(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
            lane=lane,
            sampling_params=dict(sampling_params or {}),
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            priority=priority,
            model=model,
            stream=stream,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            edge_ms=max(0.0, (now - arrival_monotonic) * 1000.0) if arrival_monotonic else 0.0,
            job_id=job_id,
            custom_id=custom_id,
        )
        p.Submit.from_payload(msg.payload())  # validate here, not at the broker
        if self._sock is None:
            raise RuntimeError("BrokerClient.start() was not called")
        if msg.request_id in self._streams:
            raise ValueError(f"request {msg.request_id!r} is already in flight on this client")
        queue: asyncio.Queue[Result] = asyncio.Queue()
        self._streams[msg.request_id] = queue
        self._send_nowait(msg)
        return RequestStream(self, msg.request_id, queue)

    async def status(self, timeout_s: float = 5.0) -> p.StatusReply:
        """The broker's status (workers, queues, counters). Raises TimeoutError."""
        rid = uuid.uuid4().hex
        fut: asyncio.Future[p.StatusReply] = asyncio.get_running_loop().create_future()
        self._status_waiters[rid] = fut
        try:
            self._send_nowait(p.StatusRequest(request_id=rid))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._status_waiters.pop(rid, None)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ internals

    def report_edge_timings(
        self, request_id: str, ttft_ms: float | None, e2e_ms: float | None
    ) -> None:
        """Tell the broker this edge's TTFT and e2e (ms) for a finished request (stored in SQL)."""
        self._send_nowait(p.EdgeTimings(request_id=request_id, ttft_ms=ttft_ms, e2e_ms=e2e_ms))

    def _send_nowait(self, msg: p.Message) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send_multipart(msg.to_frames(), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("broker client send queue full: dropped %s", msg.KIND)

    async def _reader(self) -> None:
        assert self._sock is not None
        sock = self._sock
        # A synchronous shadow of the same socket drains what is already queued without one
        # event-loop round trip per message (pyzmq re-checks EVENTS on every new async recv).
        shadow = zmq.Socket.shadow(sock.underlying)
        while True:
            batch = [await sock.recv_multipart()]
            for _ in range(512):
                try:
                    batch.append(shadow.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
            self._last_heard = time.monotonic()
            for frames in batch:
                self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = p.decode(frames, p.BROKER_TO_CLIENT)
        except p.ProtocolError as exc:
            self.invalid_messages += 1
            logger.warning("invalid message from broker: %s", exc)
            return
        kind = type(msg)
        if kind is p.Heartbeat:
            if self.epoch is not None and msg.epoch != self.epoch:
                self._fail_all(f"broker restarted (epoch {self.epoch} -> {msg.epoch})")
            self.epoch = msg.epoch
        elif kind is p.StatusReply:
            fut = self._status_waiters.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            if self.epoch is None:
                self.epoch = msg.epoch
        else:
            queue = self._streams.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)

    async def _heartbeat(self) -> None:
        hello = p.Hello(client_id=self.client_id)
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            if not self._streams:
                self._last_heard = time.monotonic()
                continue
            self._send_nowait(hello)
            if time.monotonic() - self._last_heard > self.liveness_s:
                self._fail_all(f"broker silent for more than {self.liveness_s:.1f}s")
                self._last_heard = time.monotonic()

    def _fail_all(self, why: str) -> None:
        logger.warning("%s: failing %d in-flight requests", why, len(self._streams))
        for rid, queue in list(self._streams.items()):
            queue.put_nowait(
                p.Error(request_id=rid, code="worker_lost", message=why, retryable=True)
            )
            self._streams.pop(rid, None)


class RequestStream:
    """Async iterator over one request's messages: Delta ... then one Final or Error.

    Leaving early aborts the request on the broker: ``aclose()``, cancelling the task that
    awaits it, or dropping the last reference to an unfinished stream.
    """

    def __init__(self, client: BrokerClient, request_id: str, queue: asyncio.Queue[Result]):
        self._client = client
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Result:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._abort()
            raise
        if type(item) is not p.Delta:
            self._done = True
            self._client._streams.pop(self.request_id, None)
        return item

    async def aclose(self) -> None:
        """Abort the request unless it already ended."""
        self._abort()

    def _abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._client._streams.pop(self.request_id, None) is not None:
            self._client._send_nowait(p.Abort(request_id=self.request_id))

    def __del__(self) -> None:
        self._abort()


def broker_status(address: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """Synchronous status call for the CLI: ``{"epoch", "workers", "queues", "counters"}``.

    Raises TimeoutError when the broker does not answer within ``timeout_s``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    p.secure_socket_options(sock)
    try:
        sock.connect(address)
        rid = uuid.uuid4().hex
        sock.send_multipart(p.StatusRequest(request_id=rid).to_frames())
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(left * 1000):
                break
            try:
                msg = p.decode(sock.recv_multipart(), p.BROKER_TO_CLIENT)
            except p.ProtocolError:
                continue
            if type(msg) is p.StatusReply and msg.request_id == rid:
                return {
                    "epoch": msg.epoch,
                    "workers": msg.workers,
                    "queues": msg.queues,
                    "counters": msg.counters,
                }
        raise TimeoutError(f"broker at {address} did not answer within {timeout_s}s")
    finally:
        sock.close(linger=0)
