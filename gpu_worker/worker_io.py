"""The worker's IO thread (see gpu_worker/worker.py for the two-thread picture).

It owns the ZMQ DEALER to the broker and an inproc PAIR to the engine loop:

- broker -> engine loop: ``request``/``abort`` decoded (and validated) once here and put, as
  typed messages, in the worker's ``inbox`` (a deque; an empty frame on the pipe wakes the engine
  loop); ``heartbeat`` watched (a new ``epoch`` -> reset) and ``disconnect`` -> reset; a reset
  (:class:`ResetEngine` in the inbox) tells the engine loop to forget everything and announces
  ``ready`` again once it confirms (:data:`RESET_DONE`);
- engine loop -> broker: ``step_outputs`` through a bounded outbox (a slow broker pauses the
  engine loop through the worker's backlog counters);
- a ``worker_heartbeat`` with load stats every ``hb_every`` seconds (at once when draining);
- broker silence for ``liveness`` intervals -> reconnect with exponential backoff (<= 30 s);
- a refused CurveZMQ handshake is logged (at most every 5 s);
- the parent pid is polled every 0.5 s (`contracts.procs.parent_gone`).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from laneserve.broker import protocol as p
from laneserve.contracts.procs import parent_gone

if TYPE_CHECKING:
    from laneserve.gpu_worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResetEngine:
    """IO thread -> engine loop: forget every request (a new or silent broker), then answer
    :data:`RESET_DONE`."""

    reason: str


# engine loop -> IO thread: the reset is done (a control frame of the pipe, never sent on)
RESET_DONE = [b"laneserve.worker.reset-done"]
_WAKE = b""  # IO thread -> engine loop: the worker's inbox has something

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_BACKOFF_MAX_S = 30.0
_PARENT_CHECK_S = 0.5
_REFUSAL_LOG_S = 5.0


def recv_all(sock: zmq.Socket, limit: int = 1000) -> list[list[bytes]]:
    """Every message waiting on `sock` (at most `limit`), without blocking."""
    out = []
    for _ in range(limit):
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


class IoLoop:
    """One run of the IO thread for `worker`; :meth:`run` returns when the worker stops.

    Shares with the engine loop only the worker's thread-safe events, its ``_stats`` snapshot and
    the flow-control counters (``_forwarded`` and ``_resets`` are written here only).
    """

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.pipe = worker.ctx.socket(zmq.PAIR)
        self.pipe.connect(worker._pipe_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.pipe, zmq.POLLIN)
        self.outbox: collections.deque[list[bytes]] = collections.deque()
        self.epoch: str | None = None
        now = time.monotonic()
        self.last_heard = now
        self.last_hb = 0.0
        self.last_parent_check = now
        self.last_refusal_log = 0.0
        self.backoff = worker.heartbeat_interval_s
        self.hb_every = worker.heartbeat_interval_s
        self.silence = worker.heartbeat_interval_s * worker.liveness
        self.announced_drain = False
        self._open_dealer()

    # ------------------------------------------------------------------ sockets

    def _open_dealer(self) -> None:
        """Connect a fresh DEALER (and its handshake monitor) and send ``ready``, unless a reset
        is pending: then ``ready`` waits for the engine loop (a second ``ready`` would tell the
        broker this worker restarted, and it would requeue what it had just sent)."""
        w = self.w
        sock = w.ctx.socket(zmq.DEALER)
        p.secure_socket_options(sock)
        sock.setsockopt(zmq.IDENTITY, w.worker_id.encode()[:255])
        sock.setsockopt(zmq.SNDHWM, 64)  # backpressure reaches the engine loop quickly
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        if w.curve is not None:
            from laneserve.broker.curve import apply_client

            apply_client(sock, *w.curve)
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        sock.connect(w.broker_addr)
        self.dealer = sock
        if not w._resets:  # else once the engine loop has forgotten its requests (RESET_DONE)
            self._announce()
        self.poller.register(self.dealer, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def _close_dealer(self) -> None:
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)

    def _announce(self) -> None:
        w = self.w
        ready = p.Ready(
            worker_id=w.worker_id,
            pid=os.getpid(),
            lanes=w.lanes,
            capacity=w.capacity,
            model=w.model,
            info=w.info,
        )
        try:
            self.dealer.send_multipart(ready.to_frames(), zmq.NOBLOCK)
        except zmq.Again:
            pass

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        try:
            while not self.w._stop.is_set():
                events = dict(self.poller.poll(50))
                now = time.monotonic()
                if self.dealer in events:
                    self._from_broker(now)
                if self.monitor in events:
                    self._log_refusals(now)
                if self.pipe in events:
                    self._from_engine()
                self._flush_outbox()
                self._heartbeat(now)
                self._check_silence(now)
                self._check_parent(now)
        finally:
            self._close_dealer()
            self.pipe.close(linger=0)

    def _from_broker(self, now: float) -> None:
        for frames in recv_all(self.dealer):
            try:
                msg = p.decode(frames, p.BROKER_TO_WORKER)
            except p.ProtocolError as exc:
                self.w.counters["invalid_messages"] += 1
                logger.warning("invalid message from broker: %s", exc)
                continue
            self.last_heard = now
            self.backoff = self.w.heartbeat_interval_s
            if type(msg) is p.Heartbeat:
                # beat at least as often as the broker does (its liveness window)
                self.hb_every = min(self.w.heartbeat_interval_s, msg.interval_s or self.hb_every)
                if self.epoch is not None and msg.epoch != self.epoch:
                    logger.warning("broker restarted (epoch %s -> %s)", self.epoch, msg.epoch)
                    self._reset("reset")
                self.epoch = msg.epoch
            elif type(msg) is p.Disconnect:
                logger.warning("broker says disconnect: %s", msg.reason)
                self._reset("reset")
                # the broker that said this may be a new one: adopt the epoch of its next
                # heartbeat instead of resetting a second time for it
                self.epoch = None
            else:
                self._to_engine(msg)

    def _log_refusals(self, now: float) -> None:
        for event in recv_all(self.monitor):
            if now - self.last_refusal_log >= _REFUSAL_LOG_S:
                self.last_refusal_log = now
                logger.error(
                    "broker %s refused the connection (handshake failed, event %s): "
                    "check --curve-server-public/--curve-client-key and the "
                    "broker's --curve-allow list",
                    self.w.broker_addr,
                    int.from_bytes(event[0][:2], "little") if event else "?",
                )

    def _from_engine(self) -> None:
        w = self.w
        for frames in recv_all(self.pipe):
            if not w._resets:
                self.outbox.append(frames)
                continue
            # output of requests the broker we left gave us: it may share a request id with a
            # resubmission the new broker sends (it must not join that)
            w._forwarded += 1
            if frames == RESET_DONE:
                w._resets -= 1
                if not w._resets:
                    self._announce()

    def _flush_outbox(self) -> None:
        while self.outbox:
            try:
                p.send_frames(self.dealer, self.outbox[0])
            except zmq.Again:
                break  # broker slow or away: keep it; the engine pauses meanwhile
            self.outbox.popleft()
            self.w._forwarded += 1

    def _heartbeat(self, now: float) -> None:
        draining = self.w._draining.is_set()
        if draining and not self.announced_drain:
            self.announced_drain, self.last_hb = True, 0.0  # tell the broker at once
        if now - self.last_hb < self.hb_every:
            return
        self.last_hb = now
        hb = p.WorkerHeartbeat(worker_id=self.w.worker_id, stats=self.w._stats, draining=draining)
        try:
            self.dealer.send_multipart(hb.to_frames(), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _check_silence(self, now: float) -> None:
        if now - self.last_heard <= max(self.silence, self.backoff):
            return
        logger.warning(
            "broker silent %.1fs: reconnecting to %s", now - self.last_heard, self.w.broker_addr
        )
        self.poller.unregister(self.dealer)
        self.poller.unregister(self.monitor)
        self._close_dealer()
        self._reset("broker silent")  # outputs for the old broker are moot
        self._open_dealer()
        self.epoch = None
        self.last_heard = now
        self.backoff = min(self.backoff * 2, _BACKOFF_MAX_S)

    def _to_engine(self, msg: p.WorkRequest | p.Abort | ResetEngine) -> None:
        self.w.inbox.append(msg)  # before the wake-up: the engine loop finds it there
        self.pipe.send(_WAKE)

    def _reset(self, reason: str) -> None:
        """Tell the engine loop to forget everything; announce ourselves again once it has
        (:meth:`_from_engine`), dropping what it sends meanwhile."""
        self._to_engine(ResetEngine(reason))
        self.w._resets += 1
        self.w._forwarded += len(self.outbox)
        self.outbox.clear()

    def _check_parent(self, now: float) -> None:
        parent = self.w.parent_pid
        if not parent or now - self.last_parent_check < _PARENT_CHECK_S:
            return
        self.last_parent_check = now
        if parent_gone(parent):
            logger.warning("parent %d died: stopping", parent)
            self.w._stop.set()
