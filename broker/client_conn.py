"""The broker client's connections: one DEALER socket (and its ZMQ monitor) at a time.

Broker restarts (DESIGN.md "Scale beyond one machine"): the client talks to the broker over one
*connection* at a time (a DEALER socket and its ZMQ monitor). A connection is *up* once the
broker answered its ``hello`` with a heartbeat carrying the broker's epoch; requests are sent
only on an up connection, and a request submitted while none is up waits for one. The client
*leaves* a connection when

- ZMQ reports the peer disconnected (a broker killed or restarted: noticed at once),
- a heartbeat or status reply on it carries another epoch than the one it started with, or
- the broker stays silent for ``liveness_s`` while requests are in flight (``hello`` goes out
  every ``heartbeat_interval_s`` meanwhile).

Leaving closes the socket, so nothing the old broker sends afterwards is read (an answer of an
epoch the client left never reaches a caller), and opens a new connection. A stream that already
yielded a Delta with content ends with a retryable ``worker_lost`` error; every other request in
flight (non-streaming ones, streams without a token yet) is resubmitted to the broker on the new
connection under the same request id, keeping its deadline; the caller sees nothing of it but
the added latency. A request waiting for a connection ends at its ``deadline`` with
``deadline_exceeded``, or, without one, after ``connect_timeout_s`` with a retryable
``no_worker``. A broker that still holds a resubmitted id (a reconnect without a restart) follows
it on the new connection.

:class:`Connections` is an object :class:`laneserve.broker.client.BrokerClient` holds: it owns the
current :class:`Conn`, whether it is up, the broker's ``epoch``, the ``hello`` heartbeat and
liveness. The requests are the client's; the connections reach them only through the small
:class:`RequestSide` interface the client implements (messages read, requests of a connection
left, a connection up, requests waiting too long, whether any request waits on an answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from laneserve.broker import protocol as p

logger = logging.getLogger(__name__)

_DRAIN_BATCH = 512  # messages handled per event-loop round


@dataclass(slots=True)
class Conn:
    """One connection to the broker: a DEALER socket, its monitor and their tasks."""

    gen: int
    sock: zmq.asyncio.Socket
    shadow: zmq.Socket  # synchronous view of ``sock`` (drains without event-loop round trips)
    monitor: zmq.asyncio.Socket
    opened: float  # monotonic s
    hello_at: float = 0.0  # monotonic s of the last hello sent
    epoch: str | None = None  # the broker's epoch as first heard here; None: not up yet
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False


class RequestSide(Protocol):
    """What :class:`Connections` asks of the client that owns the requests."""

    def on_frames(self, conn: Conn, frames: list[bytes]) -> None:
        """Handle one message read on ``conn``."""

    def on_left(self, conn: Conn, why: str) -> tuple[int, int]:
        """``conn`` was left: end or requeue the requests sent on it; (ended, requeued)."""

    def on_up(self, conn: Conn, previous_epoch: str | None, now: float) -> None:
        """``conn`` is up (its epoch set): send every request waiting for a connection."""

    def expire_waiting(self, now: float) -> None:
        """End the requests that waited too long for a connection."""

    def awaits_answer(self, conn: Conn) -> bool:
        """Whether a request or status call sent on ``conn`` waits for the broker."""


class Connections:
    """The broker client's connection (module docstring): opening, watching, reading, leaving
    and replacing it, the ``hello`` heartbeat and liveness.

    Given the ZMQ ``ctx``, the broker's ``address``, the client's ``client_id`` (its ``hello``),
    ``heartbeat_interval_s``, ``liveness_s``, the client's ``counters`` (``connections`` and
    ``stream_lost`` are counted here) and ``requests``, the client's :class:`RequestSide`.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        client_id: str,
        *,
        heartbeat_interval_s: float,
        liveness_s: float,
        counters: dict[str, int],
        requests: RequestSide,
    ) -> None:
        self.ctx = ctx
        self.address = address
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness_s = liveness_s
        self.counters = counters
        self._requests = requests
        self.conn: Conn | None = None  # the current connection; None before start, after close
        self.epoch: str | None = None  # the epoch of the broker last heard
        self._up = asyncio.Event()
        self._last_heard = 0.0
        self._hello = p.Hello(client_id=client_id).to_frames()
        self._heartbeat_task: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        """True while a connection is up (the broker answered on it)."""
        return self._up.is_set()

    def start(self) -> None:
        """Open the first connection and start the heartbeat (returns at once)."""
        self._last_heard = time.monotonic()
        self.conn = self._open(1)
        self._heartbeat_task = asyncio.create_task(
            self._heartbeat(), name="broker-client-heartbeat"
        )

    async def close(self) -> None:
        """Stop the heartbeat and the connection's tasks, then close it."""
        conn = self.conn
        tasks = [self._heartbeat_task] if self._heartbeat_task is not None else []
        tasks += conn.tasks if conn else []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._heartbeat_task = None
        if conn is not None:
            self._close_conn(conn, linger_ms=100)
            self.conn = None
        self._up.clear()

    def _open(self, gen: int) -> Conn:
        sock = self.ctx.socket(zmq.DEALER)
        p.secure_socket_options(sock)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        conn = Conn(
            gen=gen,
            sock=sock,
            shadow=zmq.Socket.shadow(sock.underlying),
            monitor=monitor,
            opened=time.monotonic(),
        )
        conn.tasks = [
            asyncio.create_task(self._reader(conn), name=f"broker-client-reader-{gen}"),
            asyncio.create_task(self._watch(conn), name=f"broker-client-monitor-{gen}"),
        ]
        self.counters["connections"] += 1
        self._send_hello(conn)  # queued until connected; the answer brings the epoch
        return conn

    def _close_conn(self, conn: Conn, linger_ms: int = 0) -> None:
        if conn.closed:
            return
        conn.closed = True
        current = asyncio.current_task()
        for task in conn.tasks:
            if task is not current:
                task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            conn.sock.disable_monitor()
        conn.monitor.close(linger=0)
        conn.sock.close(linger=linger_ms)

    def _leave(self, conn: Conn, why: str) -> None:
        """Stop using ``conn``: fail the streams that delivered content, queue the other requests
        sent on it for the next connection, and open that connection."""
        if conn is not self.conn or conn.closed:
            return
        self._close_conn(conn)
        self._up.clear()
        lost, waiting = self._requests.on_left(conn, why)
        self.counters["stream_lost"] += lost
        logger.warning(
            "%s: reconnecting (%d streams end with worker_lost, %d requests wait to be resent)",
            why,
            lost,
            waiting,
        )
        self.conn = self._open(conn.gen + 1)

    def _on_up(self, conn: Conn, epoch: str) -> None:
        """The broker answered on ``conn``: the requests side sends what waits for it."""
        now = time.monotonic()
        conn.epoch = epoch
        previous, self.epoch = self.epoch, epoch
        self._last_heard = now
        self._up.set()
        self._requests.on_up(conn, previous, now)

    def _send_hello(self, conn: Conn) -> None:
        conn.hello_at = time.monotonic()
        self.send(conn, self._hello)

    def send(self, conn: Conn, frames: list[bytes]) -> None:
        """Send ``frames`` on ``conn`` without blocking (nothing once it is closed)."""
        if conn.closed:
            return
        try:
            conn.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("broker client send queue full: dropped a message")

    async def _reader(self, conn: Conn) -> None:
        # Wait for readability, then drain with the synchronous shadow: no message is ever held
        # in a pending future, so leaving the connection (below) loses nothing already received.
        while not conn.closed:
            await conn.sock.poll(flags=zmq.POLLIN)
            self._drain(conn)

    def _drain(self, conn: Conn) -> bool:
        """Handle the messages queued on ``conn``; True if more may be waiting."""
        for i in range(_DRAIN_BATCH):
            if conn.closed:
                return False
            try:
                frames = conn.shadow.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if not i:
                self._last_heard = time.monotonic()
            try:
                self._requests.on_frames(conn, frames)
            except Exception:  # one message's handling must not end the reader (and with it
                logger.exception("broker client: handling a message failed")  # every request)
        return True

    async def _watch(self, conn: Conn) -> None:
        while not conn.closed:
            event = parse_monitor_message(await conn.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and not conn.closed:
                while self._drain(conn):  # what the broker sent before it went away counts
                    pass
                self._leave(conn, f"lost the connection to the broker (epoch {conn.epoch})")
                return

    def on_epoch(self, conn: Conn, epoch: str) -> None:
        """The broker's epoch as a heartbeat or status reply on ``conn`` carries it."""
        if conn.epoch is None:
            self._on_up(conn, epoch)
        elif epoch != conn.epoch:  # the socket reconnected to a new broker by itself
            self._leave(conn, f"broker restarted (epoch {conn.epoch} -> {epoch})")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            conn = self.conn
            if conn is None:
                continue
            now = time.monotonic()
            self._requests.expire_waiting(now)
            if conn.epoch is None:
                if now - conn.hello_at > self.liveness_s:
                    self._send_hello(conn)  # still connecting (the first one is queued)
                continue
            if not self._requests.awaits_answer(conn):
                self._last_heard = now
                continue
            self._send_hello(conn)
            if now - self._last_heard > self.liveness_s:
                self._leave(conn, f"broker silent for more than {self.liveness_s:.1f}s")
                self._last_heard = time.monotonic()
