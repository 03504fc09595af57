"""Broker clients: :class:`BrokerClient` (asyncio) and :func:`broker_status` (sync, for the CLI).

Usage::

    async with BrokerClient("ipc:///.../broker-front.sock") as client:
        async for msg in client.submit(prompt="Hi", lane="interactive",
                                       sampling_params={"max_tokens": 16}):
            if isinstance(msg, Delta): print(msg.text, end="")
            else: print(msg)            # the last item: a Final or an Error

``submit`` returns an async iterator of :class:`~laneserve.broker.protocol.Delta` messages ending with one
:class:`~laneserve.broker.protocol.Final` or :class:`~laneserve.broker.protocol.Error`; errors are yielded, not
raised, so a caller sees the broker's code (``overloaded``, ``worker_lost``, ...). Leaving the
iteration early (``break``, task cancellation, ``aclose()``) sends an ``abort``.

Broker restarts (DESIGN.md "Scale beyond one machine"): the connection and reconnect machinery is
:mod:`laneserve.broker.client_conn`, a :class:`~laneserve.broker.client_conn.Connections` object the
client holds (``connections``); the client keeps the requests and answers the connections through
their :class:`~laneserve.broker.client_conn.RequestSide` interface (``on_frames``, ``on_left``,
``on_up``, ``expire_waiting``, ``awaits_answer``). Requests in flight survive a broker restart as
described there.

A caller that shows nothing before the end (the gateway for a non-streaming HTTP response, which
streams from the broker only to time tokens at the edge) submits with ``restartable=True``: such
a request is resubmitted even after content, on a reconnect and on the broker's retryable
``worker_lost`` (a lost worker), up to ``MAX_SENDS`` sends; its stream then yields a
:class:`Restart` before the new run's messages, and the caller drops what it had.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import zmq
import zmq.asyncio

from laneserve.broker import protocol as p
from laneserve.broker.client_conn import Conn, Connections
from laneserve.contracts import defaults
from laneserve.contracts.engine_io import EngineRequest, TextRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Restart:
    """Yielded by a ``restartable`` request that runs again from the start: drop its output so
    far. ``reason``: why (a broker restart, a lost worker)."""

    request_id: str
    reason: str


Result = p.Delta | p.Final | p.Error | Restart

MAX_SENDS = 4  # sends of one request (the first + resubmissions) before a server abort is final


@dataclass(slots=True)
class _Pending:
    """One request in flight on this client."""

    submit: p.Submit
    queue: asyncio.Queue
    submitted_at: float  # time.monotonic() s of the caller's submit
    deadline: float | None  # time.monotonic() s; None: no caller deadline
    gen: int = 0  # the connection it was last sent on; 0: waiting for a connection
    wait_since: float = 0.0  # monotonic s it began waiting for a connection
    sends: int = 0
    delivered: bool = False  # a Delta with content reached the caller
    restartable: bool = False  # the caller can drop its output (it gets a Restart)
    timer: asyncio.TimerHandle | None = None
    frames: list[bytes] | None = None  # `submit` encoded, until its first send


class BrokerClient:
    """Asyncio client of the broker's front socket. One instance per event loop.

    It keeps the requests in flight; its ``connections`` (:mod:`laneserve.broker.client_conn`)
    keep the socket and reach the requests through the client's
    :class:`~laneserve.broker.client_conn.RequestSide` methods (below, after ``_send_submit``).

    ``heartbeat_interval_s``: period of ``hello`` while requests are in flight (s).
    ``liveness_s``: broker silence (s) after which the connection is replaced.
    ``connect_timeout_s``: how long a request without a deadline waits for a broker (s).
    ``counters``: ``connections`` (opened), ``resubmitted`` (requests sent again after a
    reconnect), ``stream_lost`` (streams ended with ``worker_lost`` by a reconnect),
    ``stale_messages`` (answers for requests this connection does not carry), ``expired``.
    """

    def __init__(
        self,
        address: str,
        *,
        heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S,
        liveness_s: float = defaults.CLIENT_LIVENESS_S,
        connect_timeout_s: float = 30.0,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.client_id = uuid.uuid4().hex[:12]
        self._streams: dict[str, _Pending] = {}
        self._status_waiters: dict[str, asyncio.Future[p.StatusReply]] = {}
        self.invalid_messages = 0
        self.counters = dict.fromkeys(
            ("connections", "resubmitted", "stream_lost", "stale_messages", "expired"), 0
        )
        self.connections = Connections(
            ctx or zmq.asyncio.Context.instance(),
            address,
            self.client_id,
            heartbeat_interval_s=heartbeat_interval_s,
            liveness_s=liveness_s,
            counters=self.counters,
            requests=self,
        )

    @property
    def epoch(self) -> str | None:
        """The epoch of the broker last heard."""
        return self.connections.epoch

    async def __aenter__(self) -> BrokerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and start the heartbeat task (returns at once; the broker may start later)."""
        if self.connections.conn is not None:
            return
        self.connections.start()

    async def close(self) -> None:
        """Abort what is in flight (best effort) and close the socket."""
        conn = self.connections.conn
        for rid, pend in list(self._streams.items()):
            if conn is not None and pend.gen == conn.gen:
                self.connections.send(conn, p.Abort(request_id=rid).to_frames())
            if pend.timer is not None:
                pend.timer.cancel()
        await self.connections.close()

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
        deadline: float | None = None,
        restartable: bool = False,
        task: str = "generate",
    ) -> RequestStream:
        """Send a request; returns an async iterator of Delta ... then one Final or Error.

        ``arrival_time`` (unix s) and ``arrival_monotonic`` (``time.monotonic()`` s) are when the
        edge accepted the request (default: now). ``deadline`` (``time.monotonic()`` s, optional):
        a request not finished by then is aborted and ends with ``deadline_exceeded``; it holds
        across resubmissions. ``restartable``: the caller passes nothing on before the end, so
        the request may be run again after content (module docstring). Raises ProtocolError at
        once on an invalid request (bad lane, not exactly one prompt form, unknown sampling
        field, ...). ``task``: ``"generate"`` or ``"embed"`` (the Final carries the embedding).
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
            task=task,
        )
        p.Submit.from_payload(msg.payload())  # validate here, not at the broker
        # ... and encode it: a request the wire cannot carry fails here, before it is tracked
        # (a tracked one is sent again on every reconnect, from the reader task)
        frames = msg.to_frames()
        conn = self.connections.conn
        if conn is None:
            raise RuntimeError("BrokerClient.start() was not called")
        pend = self._track(msg, now, deadline, restartable)
        pend.frames = frames  # sent as encoded here, now or once the connection is up
        if conn.epoch is not None:
            self._send_submit(conn, pend, now)
        return RequestStream(self, msg.request_id, pend.queue)

    def _track(
        self, msg: p.Submit, now: float, deadline: float | None, restartable: bool
    ) -> _Pending:
        """Register a request in flight (and its deadline timer). Raises ValueError on a
        request id already in flight here."""
        rid = msg.request_id
        if rid in self._streams:
            raise ValueError(f"request {rid!r} is already in flight on this client")
        pend = _Pending(
            submit=msg,
            queue=asyncio.Queue(),
            submitted_at=now,
            deadline=deadline,
            restartable=restartable,
            wait_since=now,
        )
        self._streams[rid] = pend
        if deadline is not None:
            pend.timer = asyncio.get_running_loop().call_later(
                max(0.0, deadline - now), self._expire, rid, pend
            )
        return pend

    def submit_request(self, request: EngineRequest | TextRequest, **edge: Any) -> RequestStream:
        """:meth:`submit` an :class:`EngineRequest` or, from an edge without a tokenizer, a
        :class:`TextRequest` (what the gateway and the jobs runner build);
        ``edge``: the other :meth:`submit` keywords (``stream``, ``model``, ``arrival_time``,
        ``deadline``, ...). Raises ProtocolError as :meth:`submit` does."""
        return self.submit(
            lane=request.lane,
            request_id=request.request_id,
            priority=request.priority,
            sampling_params=request.sampling_params,
            task=request.task,
            **request.prompt_fields(),
            **edge,
        )

    async def status(self, timeout_s: float = 5.0) -> p.StatusReply:
        """The broker's status (workers, queues, counters). Raises TimeoutError.

        Sent again on a new connection if the client reconnects meanwhile."""
        rid = uuid.uuid4().hex
        fut: asyncio.Future[p.StatusReply] = asyncio.get_running_loop().create_future()
        self._status_waiters[rid] = fut
        deadline = time.monotonic() + timeout_s
        sent_on: Conn | None = None
        try:
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"broker at {self.address} did not answer in {timeout_s}s")
                conn = self.connections.conn
                if conn is not None and conn is not sent_on:
                    sent_on = conn
                    self.connections.send(conn, p.StatusRequest(request_id=rid).to_frames())
                await asyncio.wait({fut}, timeout=min(left, 0.1))
            return fut.result()
        finally:
            self._status_waiters.pop(rid, None)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def connected(self) -> bool:
        """True while a connection is up (the broker answered on it)."""
        return self.connections.up

    def report_edge_timings(
        self, request_id: str, ttft_ms: float | None, e2e_ms: float | None
    ) -> None:
        """Tell the broker this edge's TTFT and e2e (ms) for a finished request (stored in SQL)."""
        conn = self.connections.conn
        if conn is not None:
            msg = p.EdgeTimings(request_id=request_id, ttft_ms=ttft_ms, e2e_ms=e2e_ms)
            self.connections.send(conn, msg.to_frames())

    @staticmethod
    def _restart(pend: _Pending, why: str) -> None:
        """Tell the caller of a restartable request to drop the output it got so far."""
        if pend.delivered:
            pend.delivered = False
            pend.queue.put_nowait(Restart(pend.submit.request_id, why))

    def _send_submit(self, conn: Conn, pend: _Pending, now: float) -> None:
        """Send `pend` on `conn` (its first send: the frames `submit` encoded)."""
        msg, frames, pend.frames = pend.submit, pend.frames, None
        if pend.sends:
            # The broker measures queueing from the edge's arrival: count the wait as edge time.
            edge_ms = msg.edge_ms + (now - pend.submitted_at) * 1000.0
            msg = replace(msg, edge_ms=min(edge_ms, 1e9))
            self.counters["resubmitted"] += 1
            frames = None
        pend.sends += 1
        pend.gen = conn.gen
        self.connections.send(conn, frames or msg.to_frames())

    # ------------------------------------------------------------------ RequestSide

    def on_frames(self, conn: Conn, frames: list[bytes]) -> None:
        """A message from the broker on ``conn``: a heartbeat or status reply (its epoch goes to
        the connections), or a request's Delta, Final or Error."""
        try:
            msg = p.decode(frames, p.BROKER_TO_CLIENT)
        except p.ProtocolError as exc:
            self.invalid_messages += 1
            logger.warning("invalid message from broker: %s", exc)
            return
        kind = type(msg)
        if kind is p.Heartbeat:
            self.connections.on_epoch(conn, msg.epoch)
        elif kind is p.StatusReply:
            fut = self._status_waiters.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            self.connections.on_epoch(conn, msg.epoch)
        else:
            pend = self._streams.get(msg.request_id)
            if pend is None or pend.gen != conn.gen:
                self.counters["stale_messages"] += 1
            elif kind is p.Delta:
                if msg.text or msg.token_ids:
                    pend.delivered = True
                pend.queue.put_nowait(msg)
            elif (
                kind is p.Final
                and msg.finish_reason == "abort"
                and 1 < pend.sends < MAX_SENDS
                and not pend.delivered
            ):
                # The broker aborted it for our previous connection before the resubmission
                # reached it (a reconnect without a restart): the id is free now, send it again.
                self._send_submit(conn, pend, time.monotonic())
            elif (
                kind is p.Error
                and msg.code == "worker_lost"
                and msg.retryable
                and pend.restartable
                and pend.sends < MAX_SENDS
            ):
                self._restart(pend, msg.message)  # its worker was lost after some output
                self._send_submit(conn, pend, time.monotonic())
            else:
                self._end(msg.request_id, msg)

    def on_left(self, conn: Conn, why: str) -> tuple[int, int]:
        """``conn`` was left: streams that delivered content end with a retryable
        ``worker_lost``, every other request sent on it waits for the next connection (a
        restartable one told to drop its output). Returns (ended, waiting)."""
        now = time.monotonic()
        lost = waiting = 0
        for rid, pend in list(self._streams.items()):
            if pend.gen != conn.gen:
                continue
            if pend.delivered and not pend.restartable:
                lost += 1
                err = p.Error(
                    request_id=rid,
                    code="worker_lost",
                    message=f"{why} while streaming; retry the request",
                    retryable=True,
                )
                self._end(rid, err)
            else:
                waiting += 1
                self._restart(pend, why)
                pend.gen, pend.wait_since = 0, now
        return lost, waiting

    def on_up(self, conn: Conn, previous_epoch: str | None, now: float) -> None:
        """``conn`` is up: send every request that waits for a connection."""
        waiting = [pend for pend in self._streams.values() if pend.gen == 0]
        if previous_epoch is not None and (conn.epoch != previous_epoch or waiting):
            logger.warning(
                "broker epoch %s (was %s): resubmitting %d requests",
                conn.epoch,
                previous_epoch,
                len(waiting),
            )
        for pend in waiting:
            try:
                self._send_submit(conn, pend, now)
            except p.ProtocolError as exc:  # submit() encodes first; should it still fail,
                rid = pend.submit.request_id  # that request ends, not the connection
                self._end(rid, p.Error(request_id=rid, code="invalid_request", message=str(exc)))

    def awaits_answer(self, conn: Conn) -> bool:
        """A status call waits, or a request was sent on ``conn``."""
        return bool(self._status_waiters) or any(
            pend.gen == conn.gen for pend in self._streams.values()
        )

    def expire_waiting(self, now: float) -> None:
        """Requests without a deadline wait at most ``connect_timeout_s`` for a connection."""
        for rid, pend in list(self._streams.items()):
            if pend.gen == 0 and pend.deadline is None:
                if now - pend.wait_since > self.connect_timeout_s:
                    self.counters["expired"] += 1
                    why = f"no broker answered at {self.address} for {self.connect_timeout_s:.0f}s"
                    err = p.Error(request_id=rid, code="no_worker", message=why, retryable=True)
                    self._end(rid, err)

    # ------------------------------------------------------------------ ending requests

    def _end(self, rid: str, msg: Result) -> None:
        pend = self._streams.pop(rid, None)
        if pend is None:
            return
        if pend.timer is not None:
            pend.timer.cancel()
        pend.queue.put_nowait(msg)

    def _expire(self, rid: str, pend: _Pending) -> None:
        """The caller's deadline passed: abort the request and end it with deadline_exceeded."""
        if self._streams.get(rid) is not pend:
            return
        conn = self.connections.conn
        if conn is not None and pend.gen == conn.gen:
            self.connections.send(conn, p.Abort(request_id=rid).to_frames())
        self.counters["expired"] += 1
        waited = time.monotonic() - pend.submitted_at
        why = f"not finished within its deadline ({waited:.1f}s after submit)"
        if pend.gen == 0:
            why += "; no broker connection meanwhile"
        err = p.Error(request_id=rid, code="deadline_exceeded", message=why)
        pend.timer = None
        self._end(rid, err)

    def _abort(self, rid: str) -> None:
        """The caller left early: forget the request and tell the broker."""
        pend = self._streams.pop(rid, None)
        if pend is None:
            return
        if pend.timer is not None:
            pend.timer.cancel()
        conn = self.connections.conn
        if conn is not None and pend.gen == conn.gen:
            self.connections.send(conn, p.Abort(request_id=rid).to_frames())


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
        if type(item) is not p.Delta and type(item) is not Restart:
            self._done = True
        return item

    async def aclose(self) -> None:
        """Abort the request unless it already ended."""
        self._abort()

    def _abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._client._abort(self.request_id)

    def __del__(self) -> None:
        self._abort()


def notify_worker_exited(address: str, worker_id: str, pid: int, linger_s: float = 1.0) -> None:
    """Tell the broker at ``address`` that worker ``worker_id`` (``pid``) exited (a supervisor
    saw it): fire and forget, the message waits at most ``linger_s`` for the connection."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    p.secure_socket_options(sock)
    try:
        sock.connect(address)
        sock.send_multipart(p.WorkerExited(worker_id=worker_id, pid=pid).to_frames(), zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        logger.warning("could not tell the broker that %s exited: %s", worker_id, exc)
    finally:
        sock.close(linger=int(linger_s * 1000))


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
