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

Dispatch order: interactive first whenever a worker serving it has credit; batch fills the rest,
and after ``batch_every`` consecutive interactive dispatches a waiting batch request goes first
(the minimum batch share, so batch never starves). On a worker serving both lanes, batch may use
at most ``capacity - interactive_reserve`` credits so an interactive arrival can always be sent
to the engine (which then preempts batch work, DESIGN.md "Lanes").

Worker loss: a request that has sent nothing to its client yet (any batch request without
streamed output, an interactive one before its first token) is requeued at the head of its
queue, up to ``max_attempts`` dispatches, after which it ends with a final ``worker_lost``
error (``retryable=False``). A request that already streamed output gets ``worker_lost`` with
``retryable=True``. A requeued request's last attempt runs *alone* on a worker (no other request
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
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from broker import protocol as p
from broker.procutil import pid_alive

logger = logging.getLogger(__name__)

_NOBLOCK = zmq.NOBLOCK


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Broker settings. Addresses are ZMQ endpoints (``tcp://127.0.0.1:PORT`` or ``ipc://PATH``)."""

    front: str
    back: str
    recorder: str | None = None
    heartbeat_interval_s: float = 1.0  # DESIGN.md: heartbeats every 1 s
    liveness: int = 3  # intervals of silence before a worker is lost (raise on a busy CPU)
    max_interactive_queue: int = 256  # full -> `overloaded` (HTTP 429)
    max_batch_queue: int = 20_000  # the jobs runner keeps the rest in SQL
    batch_every: int = 4  # >= 1 batch dispatch per 5 when both lanes wait: 20 % minimum share
    # Of a mixed worker's credits, the share batch may not take. Workers advertise twice their
    # engine's max_num_seqs, so batch fills every engine seat and interactive arrivals (which
    # preempt batch inside the engine) can still reach it, as many as there are seats.
    interactive_reserve_fraction: float = 0.5
    max_attempts: int = 3  # dispatches before a lost request ends with `worker_lost`
    no_worker_timeout_s: float = 30.0  # interactive waits this long without any serving worker
    record_flush_s: float = 0.5  # recorder commits finished requests within about a second
    record_batch_size: int = 512
    record_resend_s: float = 5.0  # resend an unacknowledged RecordBatch after this long
    record_retention: int = 50_000  # max records held unacknowledged; oldest dropped beyond
    snapshot_interval_s: float = 5.0  # worker_stats snapshots
    client_sndhwm: int = 100_000  # messages queued per client before it counts as not reading
    max_reads_per_poll: int = 2000
    max_drain_s: float = 0.01  # time slice per socket per loop, so heartbeats stay on time
    parent_pid: int | None = None  # exit when this process is gone (supervisor)
    curve_server_key: str | None = None  # server .key_secret file: back socket is a CURVE server
    curve_allow: str | None = None  # directory of allowed client .key files (broker/curve.py)


@dataclass(slots=True)
class WorkerState:
    identity: bytes
    worker_id: str
    pid: int
    model: str
    lanes: tuple[str, ...]
    capacity: int
    info: dict
    last_seen: float
    in_flight: set[str] = field(default_factory=set)
    num_batch: int = 0
    stats: dict = field(default_factory=dict)
    draining: bool = False
    hb_sent: float = 0.0  # monotonic time of the last heartbeat sent to it
    solo: bool = False  # runs a requeued request's last attempt alone: takes nothing else

    @property
    def credit(self) -> int:
        return self.capacity - len(self.in_flight)


@dataclass(slots=True)
class RequestState:
    submit: p.Submit
    client: bytes
    arrival: float  # broker monotonic seconds of the edge's arrival (recv - edge_ms)
    received: float  # broker monotonic seconds of the submit
    arrival_at: float  # unix seconds (display)
    worker: bytes | None = None
    worker_id: str | None = None  # the last worker it was dispatched to
    worker_model: str | None = None
    attempts: int = 0
    dispatched: float = 0.0
    first_token: float = 0.0  # monotonic, first content token seen at the broker
    sent_output: bool = False  # something was streamed to the client
    aborted: bool = False
    text: list[str] = field(default_factory=list)  # stream=False accumulation
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    num_tokens: int = 0
    lost: int = 0  # times its worker was lost before it sent anything
    solo: bool = False  # dispatched alone (its last attempt after a worker loss)


class Broker:
    """The broker event loop. ``run()`` blocks until ``stop()`` (thread-safe flag) is called.

    Public state for tests and status: ``counters`` (dict of ints), ``workers``, ``requests``.
    """

    def __init__(self, config: BrokerConfig, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self.epoch = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.ctx = ctx or zmq.Context.instance()
        self.curve = _curve_server(self.ctx, config)
        self.front = self._router(config.front, sndhwm=config.client_sndhwm, rcvhwm=100_000)
        # A small receive queue per worker: a worker that outruns the broker feels it (its
        # sends block) after a few hundred steps instead of buffering without bound.
        self.back = self._router(
            config.back, sndhwm=100_000, rcvhwm=256, handover=True, curve=self.curve
        )
        self.recorder: zmq.Socket | None = None
        if config.recorder:
            self.recorder = self.ctx.socket(zmq.DEALER)
            p.secure_socket_options(self.recorder)
            self.recorder.setsockopt(zmq.SNDHWM, 64)
            self.recorder.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while it is down
            self.recorder.connect(config.recorder)
        self.workers: dict[bytes, WorkerState] = {}
        # unknown identity -> when it was last told to disconnect (one reset per re-announce)
        self._told_disconnect: dict[bytes, float] = {}
        self.requests: dict[str, RequestState] = {}
        self.by_client: dict[bytes, set[str]] = collections.defaultdict(set)
        self.queues: dict[str, collections.deque[str]] = {
            "interactive": collections.deque(),
            "batch": collections.deque(),
        }
        self.counters: collections.Counter[str] = collections.Counter()
        self._since_batch = 0
        self._reserved: tuple[bytes, str] | None = None  # (worker, request) of a solo attempt
        self._stopped = False
        self._next_tick = 0.0
        self._last_invalid_log = 0.0
        self._last_parent_check = 0.0
        # recorder link
        self._pending_records: list[dict] = []
        self._pending_snapshots: list[dict] = []
        self._unacked: collections.OrderedDict[int, tuple[list[bytes], float, int]] = (
            collections.OrderedDict()
        )
        self._unacked_records = 0
        self._record_seq = int(time.time() * 1000) * 1000  # increasing across restarts
        self._last_flush = time.monotonic()
        self._last_snapshot = time.monotonic()

    # ----------------------------------------------------------------------------- sockets

    def _router(
        self, addr: str, *, sndhwm: int, rcvhwm: int, handover: bool = False, curve=None
    ) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        p.secure_socket_options(sock, router=True)
        if curve is not None:
            curve.apply(sock)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if handover:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind(addr)
        return sock

    def bound_address(self, which: str) -> str:
        """The endpoint actually bound (useful with ``tcp://127.0.0.1:*``)."""
        sock = {"front": self.front, "back": self.back}[which]
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def stop(self) -> None:
        self._stopped = True

    def close(self) -> None:
        for sock in (self.front, self.back, self.recorder):
            if sock is not None:
                sock.close(linger=0)
        if self.curve is not None:
            self.curve.close()

    # ----------------------------------------------------------------------------- loop

    def run(self) -> None:
        """Serve until ``stop()``; flushes pending records (best effort) and closes sockets."""
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        if self.recorder is not None:
            poller.register(self.recorder, zmq.POLLIN)
        logger.info(
            "broker epoch %s: front %s back %s recorder %s",
            self.epoch,
            self.bound_address("front"),
            self.bound_address("back"),
            self.config.recorder,
        )
        try:
            while not self._stopped:
                now = time.monotonic()
                if now >= self._next_tick:
                    self._tick(now)
                    self._next_tick = now + min(0.1, self.config.heartbeat_interval_s / 4)
                timeout_ms = max(0.0, (self._next_tick - time.monotonic()) * 1000)
                events = dict(poller.poll(timeout_ms))
                if self.back in events:
                    self._drain(self.back, self._on_worker_frames)
                if self.front in events:
                    self._drain(self.front, self._on_client_frames)
                if self.recorder is not None and self.recorder in events:
                    self._drain_recorder()
        finally:
            self._flush_records(force=True)
            self.close()

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
        cfg = self.config
        deadline = cfg.heartbeat_interval_s * cfg.liveness
        hb = p.Heartbeat(epoch=self.epoch, interval_s=cfg.heartbeat_interval_s).to_frames()
        for identity, worker in list(self.workers.items()):
            if now - worker.last_seen > deadline:
                logger.warning(
                    "worker %s (pid %d) lost: silent %.1fs",
                    worker.worker_id,
                    worker.pid,
                    now - worker.last_seen,
                )
                if self._send_worker(
                    identity, p.Disconnect(reason="liveness").to_frames(), quiet=True
                ):
                    self._told_disconnect[identity] = now  # its queued messages get no second one
                self._worker_lost(identity)
            elif now - worker.hb_sent >= cfg.heartbeat_interval_s:
                worker.hb_sent = now
                self._send_worker(identity, hb)
        self._expire_no_worker(now)
        if self.config.parent_pid and now - self._last_parent_check >= 0.5:
            self._last_parent_check = now
            if os.getppid() != self.config.parent_pid and not pid_alive(self.config.parent_pid):
                logger.warning("parent %d died: stopping", self.config.parent_pid)
                self.stop()
        if now - self._last_snapshot >= cfg.snapshot_interval_s:
            self._last_snapshot = now
            self._snapshot_workers()
        self._flush_records()
        self._resend_records(now)

    # ----------------------------------------------------------------------------- clients

    def _on_client_frames(self, identity: bytes, frames: list[bytes]) -> None:
        msg = p.decode(frames, p.CLIENT_TO_BROKER)
        if type(msg) is p.Submit:
            self._on_submit(identity, msg)
        elif type(msg) is p.Abort:
            self._on_abort(identity, msg.request_id)
        elif type(msg) is p.Hello:
            self._send_client(
                identity,
                p.Heartbeat(
                    epoch=self.epoch, interval_s=self.config.heartbeat_interval_s
                ).to_frames(),
            )
        elif type(msg) is p.StatusRequest:
            self._send_client(identity, self.status(msg.request_id).to_frames())
        elif type(msg) is p.EdgeTimings:
            if self.recorder is not None:  # a partial record: only these columns are updated
                edge = {"id": msg.request_id, "ttft_ms": msg.ttft_ms, "e2e_ms": msg.e2e_ms}
                self._pending_records.append({k: v for k, v in edge.items() if v is not None})

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
        queue = self.queues[msg.lane]
        limit = (
            self.config.max_interactive_queue
            if msg.lane == "interactive"
            else self.config.max_batch_queue
        )
        if len(queue) >= limit:
            self.counters["overloaded"] += 1
            err = p.Error(
                request_id=rid,
                code="overloaded",
                message=f"{msg.lane} queue is full ({limit})",
                retryable=True,
            )
            self._send_client(identity, err.to_frames())
            return
        arrival_at = msg.arrival_time or (time.time() - msg.edge_ms / 1000.0)
        self.requests[rid] = RequestState(
            submit=msg,
            client=identity,
            arrival=now - msg.edge_ms / 1000.0,
            received=now,
            arrival_at=arrival_at,
        )
        self.by_client[identity].add(rid)
        queue.append(rid)
        self.counters["submitted"] += 1
        self._dispatch()

    def _on_abort(self, identity: bytes, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.client != identity:
            return
        self._abort(req)

    def _abort(self, req: RequestState) -> None:
        if req.aborted:
            return
        req.aborted = True
        rid = req.submit.request_id
        self.counters["aborted"] += 1
        if req.worker is None:
            try:
                self.queues[req.submit.lane].remove(rid)
            except ValueError:
                pass
            self._finish(req, "abort", None, {}, status="aborted")
        else:
            # the worker answers with a finished output (finish_reason "abort")
            self._send_worker(req.worker, p.Abort(request_id=rid).to_frames())

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
        try:
            p.send_frames(self.front, [identity, *frames])
            return True
        except zmq.Again:
            self.counters["client_send_full"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.counters["client_unreachable"] += 1
        self._client_gone(identity)
        return False

    # ----------------------------------------------------------------------------- workers

    def _on_worker_frames(self, identity: bytes, frames: list[bytes]) -> None:
        msg = p.decode(frames, p.WORKER_TO_BROKER)
        worker = self.workers.get(identity)
        kind = type(msg)
        if kind is p.Ready:
            self._on_ready(identity, msg)
            return
        if worker is None:
            # Unknown worker (e.g. this broker restarted): make it forget and announce again.
            # A worker queues messages while the broker is away; they all arrive at once. Tell
            # it once (per liveness window) to re-announce: each Disconnect makes the worker
            # forget its requests and send Ready again, so a second one, arriving after that
            # Ready, would throw away work dispatched in between.
            self.counters["unknown_worker_messages"] += 1
            now = time.monotonic()
            told = self._told_disconnect.get(identity)
            window = self.config.heartbeat_interval_s * self.config.liveness
            if told is None or now - told > window:
                if len(self._told_disconnect) > 10_000:
                    self._told_disconnect.clear()
                if self._send_worker(
                    identity, p.Disconnect(reason="unknown worker").to_frames(), quiet=True
                ):
                    self._told_disconnect[identity] = now
            return
        worker.last_seen = time.monotonic()
        if kind is p.StepOutputs:
            self._on_step_outputs(worker, msg)
        elif kind is p.WorkerHeartbeat:
            worker.stats = msg.stats
            if msg.draining and not worker.draining:
                logger.info("worker %s draining", worker.worker_id)
            worker.draining = msg.draining
        elif kind is p.WorkerError:
            self._on_worker_error(worker, msg)

    def _on_ready(self, identity: bytes, msg: p.Ready) -> None:
        self._told_disconnect.pop(identity, None)
        if identity in self.workers:
            self._worker_lost(identity)  # it restarted: whatever it held is gone
        now = time.monotonic()
        self.workers[identity] = WorkerState(
            identity=identity,
            worker_id=msg.worker_id,
            pid=msg.pid,
            model=msg.model,
            lanes=tuple(msg.lanes),
            capacity=msg.capacity,
            info=msg.info,
            last_seen=now,
        )
        logger.info(
            "worker %s ready: pid %d lanes %s capacity %d model %s",
            msg.worker_id,
            msg.pid,
            msg.lanes,
            msg.capacity,
            msg.model,
        )
        self._send_worker(
            identity,
            p.Heartbeat(epoch=self.epoch, interval_s=self.config.heartbeat_interval_s).to_frames(),
        )
        self._dispatch()

    def _on_step_outputs(self, worker: WorkerState, msg: p.StepOutputs) -> None:
        freed = False
        now = time.monotonic()
        for out in msg.outputs:
            rid = out.request_id
            req = self.requests.get(rid)
            if req is None or req.worker != worker.identity:
                self.counters["stale_outputs"] += 1
                if not out.finished and rid not in worker.in_flight:
                    self._send_worker(worker.identity, p.Abort(request_id=rid).to_frames())
                continue
            if out.token_ids or out.text:
                self._on_output(req, out, now)
            if out.finished:
                self._release(worker, req)
                freed = True
                if out.finish_reason == "error" or out.error:
                    self._finish(
                        req,
                        "error",
                        ("engine_error", out.error or "engine error"),
                        out.metrics or {},
                        status="failed",
                    )
                else:
                    status = "aborted" if out.finish_reason == "abort" else "completed"
                    self._finish(
                        req, out.finish_reason or "stop", None, out.metrics or {}, status=status
                    )
        if freed:
            self._dispatch()

    def _on_output(self, req: RequestState, out: p.StepOutput, now: float) -> None:
        req.num_tokens += len(out.token_ids)
        if out.text and not req.first_token:
            req.first_token = now
        if req.aborted:
            return
        if req.submit.stream:
            frames = encode_delta(out.request_id, out.text, out.token_ids, out.logprobs)
            if self._send_client(req.client, frames):
                req.sent_output = True
                self.counters["deltas"] += 1
        else:
            req.text.append(out.text)
            req.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                req.logprobs = (req.logprobs or []) + list(out.logprobs)

    def _on_worker_error(self, worker: WorkerState, msg: p.WorkerError) -> None:
        if msg.request_id is None:
            logger.error("worker %s error %s: %s", worker.worker_id, msg.code, msg.message[:500])
            return
        req = self.requests.get(msg.request_id)
        if req is None or req.worker != worker.identity:
            return
        self._release(worker, req)
        self._finish(req, "error", (msg.code, msg.message), {}, status="failed")
        self._dispatch()

    def _release(self, worker: WorkerState, req: RequestState) -> None:
        rid = req.submit.request_id
        if rid in worker.in_flight:
            worker.in_flight.discard(rid)
            if req.submit.lane == "batch":
                worker.num_batch -= 1
            if req.solo:
                req.solo = worker.solo = False
        req.worker = None

    def _worker_lost(self, identity: bytes) -> None:
        worker = self.workers.pop(identity, None)
        if worker is None:
            return
        self.counters["workers_lost"] += 1
        requeue: dict[str, list[str]] = {"interactive": [], "batch": []}
        for rid in list(worker.in_flight):
            req = self.requests.get(rid)
            if req is None:
                continue
            self._release(worker, req)
            if req.aborted:
                self._finish(req, "abort", None, {}, status="aborted")
            elif req.sent_output:
                msg = "worker lost while streaming; retry the request"
                self._finish(
                    req, "error", ("worker_lost", msg), {}, status="failed", retryable=True
                )
            elif req.attempts >= self.config.max_attempts:
                msg = f"worker lost {req.attempts} times"
                self._finish(req, "error", ("worker_lost", msg), {}, status="failed")
            else:
                self.counters["requeued"] += 1
                req.lost += 1
                # forget the lost attempt's partial output (stream=False accumulates it)
                req.text, req.token_ids, req.logprobs = [], [], None
                req.num_tokens, req.first_token = 0, 0.0
                requeue[req.submit.lane].append(rid)
        for lane, rids in requeue.items():
            self.queues[lane].extendleft(reversed(rids))  # head of the queue, original order
        self._dispatch()

    def _send_worker(self, identity: bytes, frames: list[bytes], *, quiet: bool = False) -> bool:
        try:
            p.send_frames(self.back, [identity, *frames])
            return True
        except zmq.Again:
            self.counters["worker_send_full"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.counters["worker_unreachable"] += 1
        if not quiet and identity in self.workers:
            logger.warning("worker %r unreachable: treating as lost", identity[:32])
            self._worker_lost(identity)
        return False

    # ----------------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        inter, batch = self.queues["interactive"], self.queues["batch"]
        while inter or batch:
            lane = None
            if batch and (not inter or self._since_batch >= self.config.batch_every):
                worker = self._pick("batch")
                if worker is not None:
                    lane = "batch"
            if lane is None and inter:
                worker = self._pick("interactive")
                if worker is not None:
                    lane = "interactive"
            if lane is None and batch:
                worker = self._pick("batch")
                if worker is not None:
                    lane = "batch"
            if lane is None:
                return
            rid = self.queues[lane].popleft()
            if lane == "batch":
                self._since_batch = 0
            elif batch:
                self._since_batch += 1
            self._send_request(worker, self.requests[rid])

    def _needs_solo(self, req: RequestState) -> bool:
        """A request lost with a worker before, about to get its last attempt."""
        return req.lost > 0 and req.attempts + 1 >= self.config.max_attempts

    def _pick(self, lane: str) -> WorkerState | None:
        """The least-loaded worker that may take the head of ``lane``'s queue (non-empty)."""
        head = self.requests[self.queues[lane][0]]
        if self._needs_solo(head):
            return self._pick_solo(lane, head.submit.request_id)
        best, best_load = None, 2.0
        for worker in self.workers.values():
            if lane not in worker.lanes or worker.draining or worker.credit <= 0 or worker.solo:
                continue
            if lane == "batch" and len(worker.lanes) > 1:
                reserve = max(1, int(worker.capacity * self.config.interactive_reserve_fraction))
                if worker.num_batch >= max(1, worker.capacity - reserve):
                    continue
            load = len(worker.in_flight) / worker.capacity
            if load < best_load:
                best, best_load = worker, load
        return best

    def _pick_solo(self, lane: str, rid: str) -> WorkerState | None:
        """A worker for a solo attempt: one worker is reserved for it (takes nothing new, so it
        empties even under steady traffic) and it goes there once the worker is empty. One
        reservation at a time; other solo requests wait their turn."""
        self._drop_stale_reservation()
        if self._reserved is None:
            candidates = [
                w
                for w in self.workers.values()
                if lane in w.lanes and not w.draining and not w.solo
            ]
            if not candidates:
                return None
            worker = min(candidates, key=lambda w: len(w.in_flight) / w.capacity)
            worker.solo = True
            self._reserved = (worker.identity, rid)
        identity, owner = self._reserved
        worker = self.workers[identity]
        if owner != rid or worker.in_flight or lane not in worker.lanes:
            return None
        return worker

    def _drop_stale_reservation(self) -> None:
        if self._reserved is None:
            return
        identity, rid = self._reserved
        worker = self.workers.get(identity)
        req = self.requests.get(rid)
        queue = self.queues[req.submit.lane] if req is not None else None
        at_head = bool(queue) and queue[0] == rid
        if (
            worker is None
            or worker.draining
            or req is None
            or req.worker is not None
            or not at_head
        ):
            if worker is not None:
                worker.solo = False  # reserved, never got its solo request
            self._reserved = None

    def _send_request(self, worker: WorkerState, req: RequestState) -> None:
        s = req.submit
        req.worker = worker.identity
        req.worker_id = worker.worker_id
        req.worker_model = worker.model or None
        req.dispatched = time.monotonic()
        if self._needs_solo(req):
            req.solo = worker.solo = True
            self._reserved = None
            self.counters["solo_dispatches"] += 1
        req.attempts += 1
        worker.in_flight.add(s.request_id)
        if s.lane == "batch":
            worker.num_batch += 1
        work = p.WorkRequest(
            request_id=s.request_id,
            lane=s.lane,
            sampling_params=s.sampling_params,
            prompt=s.prompt,
            messages=s.messages,
            prompt_token_ids=s.prompt_token_ids,
            priority=s.priority,
            model=s.model,
            attempt=req.attempts,
        )
        self.counters["dispatched"] += 1
        self._send_worker(worker.identity, work.to_frames())

    def _expire_no_worker(self, now: float) -> None:
        queue = self.queues["interactive"]
        if not queue or any("interactive" in w.lanes for w in self.workers.values()):
            return
        while queue:
            req = self.requests[queue[0]]
            if now - req.received < self.config.no_worker_timeout_s:
                return
            queue.popleft()
            msg = "no worker serves the interactive lane"
            self._finish(req, "error", ("no_worker", msg), {}, status="failed", retryable=True)

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
        s = req.submit
        rid = s.request_id
        self.requests.pop(rid, None)
        owned = self.by_client.get(req.client)
        if owned is not None:
            owned.discard(rid)
            if not owned:
                del self.by_client[req.client]
        now = time.monotonic()
        timings = self._timings(req, metrics, now)
        usage = {
            "prompt_tokens": metrics.get("prompt_tokens"),
            "completion_tokens": metrics.get("completion_tokens", req.num_tokens),
            "cached_tokens": metrics.get("cached_tokens"),
        }
        extra = {k: metrics.get(k) for k in ("preemptions", "prefill_chunks")}
        if error is not None:
            self.counters["errors"] += 1
            frames = p.Error(
                request_id=rid,
                code=error[0],
                message=error[1],
                retryable=retryable,
                attempts=req.attempts,
            ).to_frames()
        else:
            self.counters["finished"] += 1
            final = p.Final(
                request_id=rid,
                finish_reason=finish_reason,
                usage=usage,
                timings=timings,
                text="".join(req.text),
                token_ids=req.token_ids,
                logprobs=req.logprobs,
                worker_id=req.worker_id,
                attempts=req.attempts,
            )
            frames = final.to_frames()
        if req.client:
            self._send_client(req.client, frames)
        if self.recorder is not None:
            record = self._record(req, status, finish_reason, error, usage | extra, timings)
            self._pending_records.append(record)

    @staticmethod
    def _timings(req: RequestState, m: dict, now: float) -> dict[str, float | None]:
        """Per-phase ms from the broker's monotonic intervals plus the engine's own."""
        wait_ms = (req.dispatched - req.arrival) * 1000.0 if req.dispatched else None
        sched = m.get("first_scheduled_delay_ms")
        first = m.get("first_token_delay_ms")
        queue_ms = wait_ms + sched if wait_ms is not None and sched is not None else None
        if req.first_token and req.submit.stream:
            ttft_ms = (req.first_token - req.arrival) * 1000.0
        elif wait_ms is not None and first is not None:
            ttft_ms = wait_ms + first
        else:
            ttft_ms = None
        return {
            "queue_ms": queue_ms,
            "prefill_ms": m.get("prefill_ms"),
            "ttft_ms": ttft_ms,
            "decode_ms": m.get("decode_ms"),
            "tpot_ms": m.get("tpot_ms"),
            "itl_p99_ms": m.get("itl_p99_ms"),
            "e2e_ms": (now - req.arrival) * 1000.0,
            "broker_wait_ms": wait_ms,
        }

    def _record(
        self,
        req: RequestState,
        status: str,
        finish_reason: str,
        error: tuple[str, str] | None,
        usage: dict,
        t: dict,
    ) -> dict:
        """The ``requests`` row for a finished request (docs/interfaces.md "Records to SQL")."""
        s = req.submit
        arrival_at = req.arrival_at

        def at(ms: float | None) -> float | None:
            return None if ms is None else arrival_at + ms / 1000.0

        record = {
            "id": s.request_id,
            "lane": s.lane,
            "priority": s.priority,
            "model": s.model or req.worker_model,
            "worker_id": req.worker_id,
            "status": status,
            "finish_reason": finish_reason,
            "error": None if error is None else f"{error[0]}: {error[1]}",
            "attempts": req.attempts,
            "arrival_at": arrival_at,
            "first_scheduled_at": at(t["queue_ms"]),
            "first_token_at": at(t["ttft_ms"]),
            "finished_at": at(t["e2e_ms"]),
        }
        for key in _TOKEN_FIELDS:
            record[key] = usage.get(key)
        for key in _TIMING_FIELDS:
            record[key] = t[key]
        # job_id/custom_id only when set: the recorder updates the columns a record carries,
        # and the jobs runner owns them for job lines.
        if s.job_id is not None:
            record["job_id"] = s.job_id
        if s.custom_id is not None:
            record["custom_id"] = s.custom_id
        return record

    # ----------------------------------------------------------------------------- recorder

    def _snapshot_workers(self) -> None:
        if self.recorder is None:
            return
        at = time.time()
        for w in self.workers.values():
            st = w.stats
            self._pending_snapshots.append(
                {
                    "worker_id": w.worker_id,
                    "lanes": ",".join(w.lanes),
                    "running": st.get("running"),
                    "waiting": st.get("waiting"),
                    "kv_usage": st.get("kv_usage"),
                    "prefix_hit_rate": st.get("prefix_hit_rate"),
                    "step_ms": st.get("step_ms"),
                    "tokens_per_s": st.get("tokens_per_s"),
                    "preemptions": st.get("preemptions"),
                    "at": at,
                }
            )

    def _flush_records(self, force: bool = False) -> None:
        if self.recorder is None:
            return
        now = time.monotonic()
        pending = len(self._pending_records) + len(self._pending_snapshots)
        if not pending or (
            not force
            and now - self._last_flush < self.config.record_flush_s
            and pending < self.config.record_batch_size
        ):
            return
        self._last_flush = now
        while self._pending_records or self._pending_snapshots:
            n = self.config.record_batch_size
            records, self._pending_records = self._pending_records[:n], self._pending_records[n:]
            snaps, self._pending_snapshots = (
                self._pending_snapshots[:n],
                self._pending_snapshots[n:],
            )
            self._record_seq += 1
            frames = p.RecordBatch(
                seq=self._record_seq, records=records, snapshots=snaps
            ).to_frames()
            self._unacked[self._record_seq] = (frames, 0.0, len(records) + len(snaps))
            self._unacked_records += len(records) + len(snaps)
        while self._unacked_records > self.config.record_retention and self._unacked:
            seq, (_, _, n) = self._unacked.popitem(last=False)
            self._unacked_records -= n
            self.counters["records_dropped"] += n
            logger.error(
                "recorder backlog over %d records: dropped batch %d (%d records)",
                self.config.record_retention,
                seq,
                n,
            )
        self._resend_records(now)

    def _resend_records(self, now: float) -> None:
        if self.recorder is None:
            return
        for seq, (frames, sent_at, n) in self._unacked.items():
            if sent_at and now - sent_at < self.config.record_resend_s:
                continue
            try:
                self.recorder.send_multipart(frames, _NOBLOCK)
            except zmq.Again:
                return  # recorder down or slow: keep them and try again later
            self._unacked[seq] = (frames, now, n)
            self.counters["record_batches_sent"] += 1

    def _drain_recorder(self) -> None:
        assert self.recorder is not None
        for _ in range(self.config.max_reads_per_poll):
            try:
                frames = self.recorder.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = p.decode(frames, p.RECORDER_TO_BROKER)
            except p.ProtocolError as exc:
                self._invalid(b"recorder", str(exc))
                continue
            entry = self._unacked.pop(ack.seq, None)
            if entry is not None:
                self._unacked_records -= entry[2]
                self.counters["records_acked"] += entry[2]

    # ----------------------------------------------------------------------------- status

    def status(self, request_id: str = "") -> p.StatusReply:
        """Workers (pid, lanes, model, capacity, in_flight, load), queue depths and counters."""
        now = time.monotonic()
        workers = [
            {
                "worker_id": w.worker_id,
                "pid": w.pid,
                "lanes": list(w.lanes),
                "model": w.model,
                "capacity": w.capacity,
                "in_flight": len(w.in_flight),
                "draining": w.draining,
                "last_seen_s": round(now - w.last_seen, 3),
                "load": w.stats,
                "info": w.info,
            }
            for w in self.workers.values()
        ]
        queues = {lane: len(q) for lane, q in self.queues.items()}
        queues["in_flight"] = sum(len(w.in_flight) for w in self.workers.values())
        queues["records_unacked"] = self._unacked_records
        if self.curve is not None:
            self.counters["curve_refused"] = self.curve.allow.refused
        return p.StatusReply(
            request_id=request_id,
            epoch=self.epoch,
            workers=workers,
            queues=queues,
            counters=dict(self.counters),
        )


def _curve_server(ctx: zmq.Context, config: BrokerConfig):
    """The back socket's CURVE server (``broker.curve.CurveServer``) or None.

    Raises ValueError when only one of ``curve_server_key``/``curve_allow`` is given, or when the
    back socket would listen beyond loopback without CURVE (remote workers must use CurveZMQ,
    DESIGN.md "Wire protocol"); ``broker.curve.CurveKeyError`` on bad key files.
    """
    from broker.addresses import is_local_endpoint

    if bool(config.curve_server_key) != bool(config.curve_allow):
        raise ValueError("CURVE needs both a server key (--curve-server-key) and --curve-allow")
    if not config.curve_server_key:
        if not is_local_endpoint(config.back):
            raise ValueError(
                f"back socket {config.back} is reachable from other hosts: remote workers must "
                "use CurveZMQ (--curve-server-key and --curve-allow; `laneserve keys generate`)"
            )
        return None
    from broker.curve import CurveServer

    return CurveServer(ctx, config.curve_server_key, config.curve_allow)


_TOKEN_FIELDS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "preemptions",
    "prefill_chunks",
)
_TIMING_FIELDS = (
    "queue_ms",
    "prefill_ms",
    "ttft_ms",
    "decode_ms",
    "tpot_ms",
    "itl_p99_ms",
    "e2e_ms",
)
_DELTA_KIND = p.Delta.KIND.encode()
_packb = msgpack.Packer(use_bin_type=True).pack


def encode_delta(
    request_id: str, text: str, token_ids: list[int], logprobs: list | None
) -> list[bytes]:
    """Frames of ``Delta(request_id, text, token_ids, logprobs)`` without building the object
    (the broker's hot path; byte-identical to ``Delta(...).to_frames()``)."""
    return [
        p.VERSION_TAG,
        _DELTA_KIND,
        _packb(
            {"request_id": request_id, "text": text, "token_ids": token_ids, "logprobs": logprobs}
        ),
    ]
