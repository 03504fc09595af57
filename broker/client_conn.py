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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

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


class Connections:
    """The connection half of :class:`laneserve.broker.client.BrokerClient` (a mixin): opening, watching,
    reading, leaving and replacing the connection, the ``hello`` heartbeat and liveness.

    The host class provides ``ctx``, ``address``, ``heartbeat_interval_s``, ``liveness_s``,
    ``epoch``, ``counters``, ``_conn``, ``_up``, ``_streams``, ``_status_waiters``,
    ``_last_heard``, ``_hello`` and the request side: ``_on_frames``, ``_send_submit``,
    ``_restart``, ``_end`` and ``_expire_waiting``.
    """

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
        if conn is not self._conn or conn.closed:
            return
        self._close_conn(conn)
        self._up.clear()
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
        self.counters["stream_lost"] += lost
        logger.warning(
            "%s: reconnecting (%d streams end with worker_lost, %d requests wait to be resent)",
            why,
            lost,
            waiting,
        )
        self._conn = self._open(conn.gen + 1)

    def _on_up(self, conn: Conn, epoch: str) -> None:
        """The broker answered on ``conn``: send every request that waits for a connection."""
        now = time.monotonic()
        conn.epoch = epoch
        waiting = [pend for pend in self._streams.values() if pend.gen == 0]
        if self.epoch is not None and (epoch != self.epoch or waiting):
            logger.warning(
                "broker epoch %s (was %s): resubmitting %d requests",
                epoch,
                self.epoch,
                len(waiting),
            )
        self.epoch = epoch
        self._last_heard = now
        self._up.set()
        for pend in waiting:
            try:
                self._send_submit(conn, pend, now)
            except p.ProtocolError as exc:  # submit() encodes first; should it still fail,
                rid = pend.submit.request_id  # that request ends, not the connection
                self._end(rid, p.Error(request_id=rid, code="invalid_request", message=str(exc)))

    def _send_hello(self, conn: Conn) -> None:
        conn.hello_at = time.monotonic()
        self._send(conn, self._hello)

    def _send(self, conn: Conn, frames: list[bytes]) -> None:
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
                self._on_frames(conn, frames)
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

    def _on_epoch(self, conn: Conn, epoch: str) -> None:
        if conn.epoch is None:
            self._on_up(conn, epoch)
        elif epoch != conn.epoch:  # the socket reconnected to a new broker by itself
            self._leave(conn, f"broker restarted (epoch {conn.epoch} -> {epoch})")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            conn = self._conn
            if conn is None:
                continue
            now = time.monotonic()
            self._expire_waiting(now)
            if conn.epoch is None:
                if now - conn.hello_at > self.liveness_s:
                    self._send_hello(conn)  # still connecting (the first one is queued)
                continue
            busy = self._status_waiters or any(
                pend.gen == conn.gen for pend in self._streams.values()
            )
            if not busy:
                self._last_heard = now
                continue
            self._send_hello(conn)
            if now - self._last_heard > self.liveness_s:
                self._leave(conn, f"broker silent for more than {self.liveness_s:.1f}s")
                self._last_heard = time.monotonic()
