"""The broker: routes requests from edges (gateway, jobs runner, CLI) to GPU workers.

Sockets (one small piece of code per role)::

    clients --DEALER--> [ROUTER front]            broker            [ROUTER back] <--DEALER-- workers
                                                    |
                                            [DEALER recorder] --> recorder ROUTER (db/)

It owns two lanes (an interactive queue, bounded: full -> ``overloaded``; a batch queue, bounded
in memory), credit-based dispatch (a worker never holds more requests than the ``capacity`` it
declared in ``ready``), worker liveness (heartbeats every ``heartbeat_interval_s``; a worker silent
for ``liveness`` intervals is lost), requeue on worker loss, abort forwarding, and the
finished-request records sent to the recorder. It never touches model weights or the database and
keeps no durable state: a restart changes its ``epoch`` so peers notice.

Modules: ``config.py`` (``BrokerConfig``), ``workers.py`` (registry, liveness), ``dispatch.py``
(lane queues, credits, the batch share, solo reservations), ``requests.py`` (request state,
final/error and timings), ``records.py`` (the recorder link), ``worker_side.py`` (the handlers of
worker messages: ready, step outputs, errors, worker loss and requeue; a ``WorkerSide`` object
given the registry, dispatcher, requests, counters and the broker's send, dispatch and finish
callables); this module is the event loop that routes messages between them and handles the
clients.

Worker loss: the lost worker's requests are requeued at the head of their queue, up to
``max_attempts`` dispatches, after which they end with a final ``worker_lost`` error
(``retryable=False``). A request the next worker can go on with (``RequestState.resumable``: no
grammar, no seeded sampling) is *resumed*: its next attempt carries the output tokens it had
(``WorkRequest.output_token_ids``), the engine recomputes them with the prompt and continues, so
neither a batch line's partial output nor a stream's sent tokens are lost. Any other request
starts again from its prompt if it has sent nothing to its client yet; one that already streamed
output gets ``worker_lost`` with ``retryable=True``. A requeued request's last attempt runs *alone* on a worker (no other request
is dispatched to that worker meanwhile): a request that crashes its worker every time then uses
up its own attempts without failing the requests that happened to share its worker.

All sends are non-blocking. A client whose socket is full (it does not read) or gone
(ROUTER_MANDATORY -> EHOSTUNREACH) has its requests aborted. Invalid messages are dropped,
counted in ``counters["invalid_messages"]`` and logged (rate-limited); the broker keeps running.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import time
import uuid
from typing import Any

import zmq

from laneserve.broker import protocol as p
from laneserve.broker.config import BrokerConfig
from laneserve.broker.curve import curve_server
from laneserve.broker.dispatch import Dispatcher
from laneserve.broker.protocol.sockets import bind_router
from laneserve.broker.records import ENGINE_COUNTS, RecordLink
from laneserve.broker.requests import RequestState, outcome, timings, usage
from laneserve.broker.worker_side import WorkerSide
from laneserve.broker.workers import WorkerRegistry, WorkerState
from laneserve.contracts.procs import parent_gone, pid_alive

logger = logging.getLogger(__name__)

_NOBLOCK = zmq.NOBLOCK


class Broker:
    """The broker event loop. ``run()`` blocks until ``stop()`` (thread-safe flag) is called.

    Public state for tests and status: ``counters`` (dict of ints), ``workers``, ``requests``.
    The parts it composes: :class:`~laneserve.broker.workers.WorkerRegistry` (workers, liveness),
    :class:`~laneserve.broker.dispatch.Dispatcher` (queues, credits, solo reservations),
    :class:`~laneserve.broker.worker_side.WorkerSide` (``worker_side``: worker messages, sends to
    workers, worker loss) and :class:`~laneserve.broker.records.RecordLink` (the recorder link,
    None without a recorder).
    """

    def __init__(self, config: BrokerConfig, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self.epoch = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.ctx = ctx or zmq.Context.instance()
        self.curve = curve_server(
            self.ctx, config.back, config.curve_server_key, config.curve_allow
        )
        self.front = bind_router(
            self.ctx, config.front, sndhwm=config.client_sndhwm, rcvhwm=100_000
        )
        # A small receive queue per worker: a worker that outruns the broker feels it (its
        # sends block) after a few hundred steps instead of buffering without bound.
        self.back = bind_router(
            self.ctx, config.back, sndhwm=100_000, rcvhwm=256, handover=True, curve=self.curve
        )
        self.counters: collections.Counter[str] = collections.Counter()
        self.registry = WorkerRegistry(config.heartbeat_interval_s, config.liveness)
        self.workers = self.registry.workers
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[bytes, set[str]] = collections.defaultdict(set)
        self.dispatcher = Dispatcher(config, self.workers, self.requests, self.counters)
        self.queues = self.dispatcher.queues
        self.records = RecordLink(self.ctx, config, self.counters) if config.recorder else None
        self.worker_side = WorkerSide(
            self.registry,
            self.dispatcher,
            self.requests,
            self.counters,
            max_attempts=config.max_attempts,
            send_back=lambda identity, frames: self._send(self.back, identity, frames, "worker"),
            send_client=self._send_client,
            heartbeat_frames=self._heartbeat_frames,
            dispatch=self._dispatch,
            finish=self._finish,
        )
        self._stopped = False
        self._next_tick = 0.0
        self._last_invalid_log = 0.0
        self._last_parent_check = 0.0
        self._last_snapshot = time.monotonic()

    # ----------------------------------------------------------------------------- sockets

    def bound_address(self, which: str) -> str:
        """The endpoint actually bound (useful with ``tcp://127.0.0.1:*``)."""
        sock = {"front": self.front, "back": self.back}[which]
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def stop(self) -> None:
        self._stopped = True

    def close(self) -> None:
        for sock in (self.front, self.back):
            sock.close(linger=0)
        if self.records is not None:
            self.records.close()
        if self.curve is not None:
            self.curve.close()

    # ----------------------------------------------------------------------------- loop

    def run(self) -> None:
        """Serve until ``stop()``; flushes pending records (best effort) and closes sockets."""
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        if self.records is not None:
            poller.register(self.records.sock, zmq.POLLIN)
        logger.info(
            "broker epoch %s: front %s back %s recorder %s",
            self.epoch,
            self.bound_address("front"),
            self.bound_address("back"),
            self.config.recorder,
        )
        try:
            while not self._stopped:
                self._poll_once(poller)
        finally:
            if self.records is not None:
                self.records.flush(force=True)
            self.close()

    def _poll_once(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        if now >= self._next_tick:
            self._tick(now)
            self._next_tick = now + min(0.1, self.config.heartbeat_interval_s / 4)
        timeout_ms = max(0.0, (self._next_tick - time.monotonic()) * 1000)
        events = dict(poller.poll(timeout_ms))
        if self.back in events:
            self._drain(self.back, self.worker_side.on_frames)
        if self.front in events:
            self._drain(self.front, self._on_client_frames)
        if self.records is not None and self.records.sock in events:
            self.records.drain_acks(lambda why: self._invalid(b"recorder", why))

    def _drain(self, sock: zmq.Socket, handler: Any) -> None:
        deadline = time.monotonic() + self.config.max_drain_s
        for i in range(self.config.max_reads_per_poll):
            if i & 15 == 15 and time.monotonic() > deadline:
                return
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                self._invalid(b"", "missing identity frame")
                continue
            try:
                handler(frames[0], frames[1:])
            except p.ProtocolError as exc:
                self._invalid(frames[0], str(exc))

    def _invalid(self, identity: bytes, why: str) -> None:
        self.counters["invalid_messages"] += 1
        now = time.monotonic()
        if now - self._last_invalid_log > 1.0:
            self._last_invalid_log = now
            logger.warning(
                "dropped invalid message from %r (%d so far): %s",
                identity[:16],
                self.counters["invalid_messages"],
                why[:300],
            )

    def _tick(self, now: float) -> None:
        self._check_liveness(now)
        for req in self.dispatcher.expire_no_worker(now, self.registry.serves("interactive")):
            msg = "no worker serves the interactive lane"
            self._finish(req, "error", ("no_worker", msg), {}, status="failed", retryable=True)
        self._check_parent(now)
        if self.records is None:
            return
        if now - self._last_snapshot >= self.config.snapshot_interval_s:
            self._last_snapshot = now
            self.records.add_snapshots(list(self.workers.values()))
        self.records.flush()
        self.records.resend(now)

    def _check_liveness(self, now: float) -> None:
        """Lose silent workers (telling them to disconnect) and heartbeat the others."""
        for worker in self.registry.silent(now):
            logger.warning(
                "worker %s (pid %d) lost: silent %.1fs",
                worker.worker_id,
                worker.pid,
                now - worker.last_seen,
            )
            bye = p.Disconnect(reason="liveness").to_frames()
            if self.worker_side.send(worker.identity, bye, quiet=True):
                # its queued messages get no second one
                self.registry.told_disconnect(worker.identity, now)
            self.worker_side.lost(worker.identity)
        frames = self._heartbeat_frames()
        for worker in self.registry.heartbeat_due(now):
            self.worker_side.send(worker.identity, frames)

    def _check_parent(self, now: float) -> None:
        parent = self.config.parent_pid
        if not parent or now - self._last_parent_check < 0.5:
            return
        self._last_parent_check = now
        if parent_gone(parent):
            logger.warning("parent %d died: stopping", parent)
            self.stop()

    def _heartbeat_frames(self) -> list[bytes]:
        hb = p.Heartbeat(epoch=self.epoch, interval_s=self.config.heartbeat_interval_s)
        return hb.to_frames()

    # ----------------------------------------------------------------------------- clients

    def _on_client_frames(self, identity: bytes, frames: list[bytes]) -> None:
        msg = p.decode(frames, p.CLIENT_TO_BROKER)
        if type(msg) is p.Submit:
            self._on_submit(identity, msg)
        elif type(msg) is p.Abort:
            self._on_abort(identity, msg.request_id)
        elif type(msg) is p.Hello:
            self._send_client(identity, self._heartbeat_frames())
        elif type(msg) is p.StatusRequest:
            self._send_client(identity, self.status(msg.request_id).to_frames())
        elif type(msg) is p.WorkerExited:
            self._on_worker_exited(msg)
        elif type(msg) is p.EdgeTimings:
            if self.records is not None:  # only these fields of the record are updated
                self.records.add_edge_timings(msg)

    def _on_submit(self, identity: bytes, msg: p.Submit) -> None:
        rid = msg.request_id
        now = time.monotonic()
        existing = self.requests.get(rid)
        if existing is not None:
            # Same request id resubmitted (a restarted runner, a retry): follow it from here.
            self.by_client.get(existing.client, set()).discard(rid)
            existing.client = identity
            self.by_client[identity].add(rid)
            self.counters["resubmitted"] += 1
            return
        refusal = self.dispatcher.refusal(msg)
        if refusal is not None:
            self.counters["overloaded"] += 1
            self._send_client(identity, refusal.to_frames())
            return
        arrival_at = msg.arrival_time or (time.time() - msg.edge_ms / 1000.0)
        req = RequestState(submit=msg, client=identity, received=now, arrival_at=arrival_at)
        self.requests[rid] = req
        self.by_client[identity].add(rid)
        self.dispatcher.enqueue(req)
        self.counters["submitted"] += 1
        self._dispatch()

    def _on_worker_exited(self, msg: p.WorkerExited) -> None:
        """Drop a worker its supervisor saw exit, unless that pid still runs on this host (a
        notice for a worker already dropped, by a failed heartbeat first, is only counted)."""
        self.counters["worker_exit_notices"] += 1
        for identity, worker in list(self.workers.items()):
            if worker.worker_id == msg.worker_id and worker.pid == msg.pid:
                if pid_alive(msg.pid):
                    logger.warning(
                        "worker_exited for %s ignored: pid %d runs", msg.worker_id, msg.pid
                    )
                    return
                logger.warning("worker %s (pid %d) lost: exited", worker.worker_id, worker.pid)
                self.counters["workers_exited"] += 1
                self.worker_side.lost(identity)  # requeues and dispatches
                return

    def _on_abort(self, identity: bytes, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.client != identity:
            return
        self._abort(req)

    def _abort(self, req: RequestState) -> None:
        if req.aborted:
            return
        req.aborted = True
        self.counters["aborted"] += 1
        if req.worker is None:
            self.dispatcher.remove(req)
            self._finish(req, "abort", None, {}, status="aborted")
        else:
            # the worker answers with a finished output (finish_reason "abort")
            self.worker_side.send(req.worker, p.Abort(request_id=req.request_id).to_frames())

    def _client_gone(self, identity: bytes) -> None:
        rids = self.by_client.pop(identity, set())
        if rids:
            logger.warning(
                "client %r unreachable or not reading: aborting %d requests",
                identity[:16],
                len(rids),
            )
        for rid in list(rids):
            req = self.requests.get(rid)
            if req is not None:
                req.client = b""
                self._abort(req)

    def _send_client(self, identity: bytes, frames: list[bytes]) -> bool:
        if not identity:
            return False
        if self._send(self.front, identity, frames, "client"):
            return True
        self._client_gone(identity)
        return False

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[bytes], peer: str) -> bool:
        """Send without blocking on a ROUTER socket; False (counted as ``{peer}_send_full`` or
        ``{peer}_unreachable``) when the peer's queue is full or the peer is gone."""
        try:
            p.send_frames(sock, [identity, *frames])
            return True
        except zmq.Again:
            self.counters[f"{peer}_send_full"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.counters[f"{peer}_unreachable"] += 1
        return False

    # ----------------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        """Send queued requests while some worker has credit for them."""
        while (pick := self.dispatcher.next()) is not None:
            self._send_request(*pick)

    def _send_request(self, worker: WorkerState, req: RequestState) -> None:
        self.dispatcher.assign(worker, req, time.monotonic())
        work = req.work()
        self.counters["dispatched"] += 1
        self.worker_side.send(worker.identity, work.to_frames())

    # ----------------------------------------------------------------------------- finish

    def _finish(
        self,
        req: RequestState,
        finish_reason: str,
        error: tuple[str, str] | None,
        metrics: dict,
        *,
        status: str,
        retryable: bool = False,
    ) -> None:
        """End ``req``: forget it, send its final (or error) to the client, record it."""
        rid = req.request_id
        self.requests.pop(rid, None)
        owned = self.by_client.get(req.client)
        if owned is not None:
            owned.discard(rid)
            if not owned:
                del self.by_client[req.client]
        timings_ = timings(req, metrics, time.monotonic())
        usage_ = usage(req, metrics)
        self.counters["errors" if error is not None else "finished"] += 1
        end = outcome(req, finish_reason, error, usage_, timings_, retryable)
        if req.client:
            self._send_client(req.client, end.to_frames())
        if self.records is not None:
            counts = usage_ | {k: metrics.get(k) for k in ENGINE_COUNTS}
            self.records.add_request(req, status, finish_reason, error, counts, timings_)

    # ----------------------------------------------------------------------------- status

    def status(self, request_id: str = "") -> p.StatusReply:
        """Workers (pid, lanes, model, capacity, in_flight, load), queue depths and counters."""
        queues: dict[str, int] = self.dispatcher.depths()
        queues["in_flight"] = sum(len(w.in_flight) for w in self.workers.values())
        queues["records_unacked"] = self.records.unacked_items if self.records else 0
        if self.curve is not None:
            self.counters["curve_refused"] = self.curve.allow.refused
        return p.StatusReply(
            request_id=request_id,
            epoch=self.epoch,
            workers=self.registry.status(time.monotonic()),
            queues=queues,
            counters=dict(self.counters),
        )


__all__ = ["Broker", "BrokerConfig"]
