"""The worker process: one engine, one accelerator, a DEALER connection to the broker.

Two threads::

    broker ROUTER <--DEALER--> [IO thread] <--inproc PAIR--> [engine loop (main thread)]

- The **IO thread** (``gpu_worker.worker_io.IoLoop``) owns the ZMQ DEALER. It decodes each
  ``request``/``abort`` from the broker once and hands the typed message to the engine loop
  through the worker's ``inbox`` (the PAIR only wakes the engine loop), forwards the engine loop's ``step_outputs`` to the broker, sends ``ready`` on
  connect and a ``worker_heartbeat`` with load stats every ``heartbeat_interval_s`` (from this
  thread, never the engine loop, so a long step cannot make the worker look dead), watches the
  broker's heartbeats (silence for ``liveness`` intervals -> reconnect with exponential backoff;
  a new broker ``epoch`` or a ``disconnect`` -> forget all requests and send ``ready`` again), and
  polls the parent pid (``parent_pid``) so the worker exits when its supervisor dies.
- The **engine loop** drives any `gpu_worker.engine_protocol.Engine` (``LLMEngine``,
  ``SyntheticEngine``): ``add`` (an ``EngineRequest``), ``step() -> list[EngineOutput]``, ``abort_request``,
  ``has_unfinished_requests``, ``stats``. A request whose prompt came as text (a sender without a
  tokenizer) is templated and tokenized first by the engine's front end (``engine.prompts``,
  gpu_worker/prompt_encoder.py; on this thread, which owns the tokenizer the detokenizer uses),
  so ``add`` gets ids; a bad prompt is an error for that request only. It sends exactly **one** ``step_outputs`` message per
  engine step carrying every request's delta/final/error. An aborted request always gets a
  final output with ``finish_reason="abort"`` (synthesized if the engine emits none) so the
  broker frees its credit.

SIGTERM drains: the worker announces ``draining`` (the broker stops dispatching to it), finishes
what it holds (at most ``drain_timeout_s``), then exits. A second SIGTERM stops at once.

A broker on another host is reached with CurveZMQ: ``curve_server_public`` (the broker's
``server.key``) and ``curve_client_key`` (this worker's ``NAME.key_secret``), see broker/curve.py.
A refused handshake (key not on the broker's allow-list) is logged as an error; the worker keeps
retrying and never registers.

Test-only faults are an engine wrapper the entry point installs (gpu_worker/faults.py); this
module knows nothing of them.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

from laneserve.broker import protocol as p
from laneserve.contracts import defaults, env
from laneserve.contracts.engine_io import EngineOutput
from laneserve.gpu_worker.engine_protocol import Engine
from laneserve.gpu_worker.worker_io import RESET_DONE, IoLoop, ResetEngine

logger = logging.getLogger(__name__)

_ERROR_CODES = {"PromptTooLongError": "prompt_too_long", "InvalidRequestError": "invalid_request"}


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _plain_stats(stats: dict) -> dict[str, Any]:
    return {
        str(k)[:64]: v for k, v in stats.items() if v is None or type(v) in (int, float, str, bool)
    }


def _curve_keys(
    ctx: zmq.Context, server_public: str | None, client_key: str | None
) -> tuple[str, str] | None:
    """The CURVE key pair to connect with (None: plain), checked now so bad key files fail fast.

    Raises ValueError when only one of the two is given.
    """
    if not (server_public or client_key):
        return None
    from laneserve.broker.curve import apply_client

    if not (server_public and client_key):
        raise ValueError("CURVE needs both the server public key and a client key")
    probe = ctx.socket(zmq.DEALER)
    try:
        apply_client(probe, server_public, client_key)  # fail fast on bad key files
    finally:
        probe.close(linger=0)
    return server_public, client_key


class Worker:
    """Connects ``engine`` to the broker at ``broker_addr``; ``run()`` blocks until stopped.

    ``capacity`` is the worker's credit: the most requests the broker may hand it at once
    (should exceed the engine's ``max_num_seqs`` a little so interactive arrivals reach the
    engine's preemption logic).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        broker_addr: str,
        lanes: Iterable[str] = ("interactive", "batch"),
        capacity: int = 64,
        model: str = "",
        worker_id: str | None = None,
        heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S,
        liveness: int = defaults.LIVENESS,
        parent_pid: int | None = None,
        drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S,
        stats_interval_s: float = 0.25,
        info: dict | None = None,
        ctx: zmq.Context | None = None,
        curve_server_public: str | None = None,
        curve_client_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.broker_addr = broker_addr
        self.lanes = [str(lane) for lane in lanes]
        for lane in self.lanes:
            if lane not in p.LANES:
                raise ValueError(f"unknown lane {lane!r}; expected one of {p.LANES}")
        self.capacity = int(capacity)
        self.model = model
        self.worker_id = worker_id or default_worker_id()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness = liveness
        self.parent_pid = parent_pid
        self.drain_timeout_s = drain_timeout_s
        self.stats_interval_s = stats_interval_s
        self.info = info or {}
        self.ctx = ctx or zmq.Context.instance()
        self._pipe_addr = f"inproc://worker-{id(self)}"
        self._stop = threading.Event()  # stop now
        self._draining = threading.Event()
        self._stats: dict[str, Any] = {}
        self.active: set[str] = set()
        self._pending_aborts: set[str] = set()
        self._parked: list[p.WorkRequest] = []  # see `_add`
        # IO thread -> engine loop: decoded broker messages and resets (one writer, one reader)
        self.inbox: collections.deque[p.WorkRequest | p.Abort | ResetEngine] = collections.deque()
        self._step_ms_ema = 0.0
        self._tokens_window: list[tuple[float, int]] = []
        self.counters: dict[str, int] = {"steps": 0, "requests": 0, "invalid_messages": 0}
        # Flow control: messages the engine loop handed to the IO thread vs. those the IO
        # thread got onto the broker socket. Each counter has one writer thread.
        self._handed = 0
        self._forwarded = 0
        self._resets = 0  # IO thread: resets the engine loop has not confirmed yet
        self.max_backlog = 64  # engine steps waiting for the broker before the engine pauses
        self.curve = _curve_keys(self.ctx, curve_server_public, curve_client_key)

    # ------------------------------------------------------------------ public

    def request_stop(self, drain: bool = True) -> None:
        """Drain (finish held requests, take no new ones) or stop at once. Thread-safe."""
        if drain and not self._draining.is_set():
            logger.info("worker %s draining (%d active)", self.worker_id, len(self.active))
            self._draining.set()
        else:
            self._stop.set()

    def run(self) -> int:
        """Run the IO thread and the engine loop; returns the exit code (0)."""
        # The IO thread must get the GIL quickly while the engine loop runs Python code
        # (default switch interval 5 ms would add up to 5 ms to every forwarded step).
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.request_stop(drain=True))
            signal.signal(signal.SIGINT, lambda *_: self.request_stop(drain=False))
        pipe = self.ctx.socket(zmq.PAIR)
        pipe.bind(self._pipe_addr)
        interleave = getattr(self.engine, "interleave", None)
        if interleave is not None and env.get("LANESERVE_INTERLEAVE"):
            interleave.install(lambda: self._between_layers(pipe))
        io = threading.Thread(target=self._io_main, name="worker-io", daemon=True)
        io.start()
        try:
            self._engine_loop(pipe)
        finally:
            self._stop.set()
            io.join(timeout=5)
            pipe.close(linger=0)
        logger.info("worker %s stopped", self.worker_id)
        return 0

    # ------------------------------------------------------------------ engine loop

    def _engine_loop(self, pipe: zmq.Socket) -> None:
        drain_deadline = None
        last_stats = 0.0
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests() or bool(self._pending_aborts)
            blocked = self._handed - self._forwarded > self.max_backlog
            if pipe.poll(0 if busy and not blocked else (1 if blocked else 50)):
                self._drain_pipe(pipe)
            if blocked:
                self.counters["backpressure_waits"] = self.counters.get("backpressure_waits", 0) + 1
            elif self.engine.has_unfinished_requests():
                self._step(pipe)
            elif self._pending_aborts:
                self._send_outputs(pipe, [], 0.0)
            now = time.monotonic()
            if now - last_stats >= self.stats_interval_s:
                last_stats = now
                self._update_stats(now)
            if self._draining.is_set():
                drain_deadline = drain_deadline or now + self.drain_timeout_s
                if not self.active or now > drain_deadline:
                    if self.active:
                        logger.warning("drain timeout: %d requests unfinished", len(self.active))
                    self._update_stats(now)
                    time.sleep(min(0.2, self.heartbeat_interval_s))  # last heartbeat goes out
                    return

    def _drain_pipe(self, pipe: zmq.Socket) -> None:
        """Take the IO thread's wake-ups, then every message it decoded into the inbox."""
        while True:
            try:
                pipe.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while self.inbox:
            msg = self.inbox.popleft()
            if type(msg) is p.WorkRequest:
                self._add(pipe, msg)
            elif type(msg) is p.Abort:
                if msg.request_id in self.active:
                    self._safe_abort(msg.request_id)
                    self._pending_aborts.add(msg.request_id)
            elif type(msg) is ResetEngine:
                self._forget_all()
                self._hand(pipe, RESET_DONE)  # what follows is for the broker we announce to

    def _add(self, pipe: zmq.Socket, msg: p.WorkRequest) -> None:
        rid = msg.request_id
        if rid in self.active:
            return  # duplicate dispatch; already running
        interleave = getattr(self.engine, "interleave", None)
        if interleave is not None and interleave.aborting(rid):
            self._parked.append(msg)  # added once the step in flight ends its earlier attempt
            return
        try:
            # a text prompt (a sender without a tokenizer) is templated and tokenized here, by
            # the engine's front end: the engine itself takes ids only
            request = msg.engine_request(time.monotonic(), self.engine.prompts.encode)
            self.engine.add(request)
        except Exception as exc:  # bad input -> a typed error for this request, keep serving
            code = _ERROR_CODES.get(type(exc).__name__)
            if (
                code == "prompt_too_long"
                and msg.output_token_ids
                and exc.prompt_tokens < exc.max_model_len
            ):
                # resumed past this worker's max_model_len: it ends as it would have run here
                final = EngineOutput(rid, "", [], True, "length")
                self._hand(
                    pipe, p.StepOutputs(worker_id=self.worker_id, outputs=[final]).to_frames()
                )
                return
            if code is None:
                code = "invalid_request" if isinstance(exc, ValueError) else "engine_error"
            if code == "engine_error":
                logger.exception("adding request %s failed", rid)
            err = p.WorkerError(
                worker_id=self.worker_id, code=code, message=str(exc)[:2000], request_id=rid
            )
            self._hand(pipe, err.to_frames())
            return
        self.active.add(rid)
        self.counters["requests"] += 1

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            logger.exception("abort_request(%s) failed", rid)

    def _forget_all(self) -> None:
        """The broker forgot us (restart, missed liveness): drop everything silently."""
        if self.active:
            logger.warning("broker reset: aborting %d requests", len(self.active))
        for rid in list(self.active):
            self._safe_abort(rid)
        self.active.clear()
        self._pending_aborts.clear()
        self._parked.clear()

    def _between_layers(self, pipe: zmq.Socket) -> None:
        """Between two layers of a batch-only step (gpu_worker/interleave.py): take what arrived
        meanwhile, then run one interactive step if one is due, its outputs sent at once. What
        that step raises ends interleaving for the step in flight (`Interleaver`), nothing else."""
        if self.inbox:
            self._drain_pipe(pipe)
        interleave = self.engine.interleave
        if interleave.due():
            t0 = time.monotonic()
            deltas = interleave.run_step()
            if deltas:
                self.counters["interleaved_steps"] = self.counters.get("interleaved_steps", 0) + 1
                self._emit(pipe, deltas, t0, 0.0)

    def _step(self, pipe: zmq.Socket) -> None:
        t0 = time.monotonic()
        try:
            deltas = self.engine.step()
        except Exception as exc:  # an engine bug must not take the worker down silently
            logger.exception("engine.step() raised; failing %d requests", len(self.active))
            outputs = [
                EngineOutput(rid, "", [], True, "error", error=f"engine step failed: {exc}"[:2000])
                for rid in self.active
            ]
            for rid in list(self.active):
                self._safe_abort(rid)
            self.active.clear()
            self._pending_aborts.clear()
            self._send_outputs(pipe, outputs, 0.0)
            return
        step_ms = (time.monotonic() - t0) * 1000.0
        self._step_ms_ema = (
            step_ms if not self._step_ms_ema else 0.9 * self._step_ms_ema + 0.1 * step_ms
        )
        self.counters["steps"] += 1
        self._emit(pipe, deltas, t0, step_ms)
        if self._parked:  # sent again while their earlier attempt's abort waited for the step
            parked, self._parked = self._parked, []
            for msg in parked:
                self._add(pipe, msg)

    def _emit(self, pipe: zmq.Socket, deltas: list[EngineOutput], t0: float, ms: float) -> None:
        """Send a step's outputs for the requests this worker still holds."""
        outputs = [d for d in deltas if d.request_id in self.active]  # the wire items as they are
        ntok = 0
        for d in outputs:
            ntok += len(d.new_token_ids)
            if d.finished:
                self.active.discard(d.request_id)
                self._pending_aborts.discard(d.request_id)
        self._tokens_window.append((t0, ntok))
        self._send_outputs(pipe, outputs, ms)

    def _send_outputs(self, pipe: zmq.Socket, outputs: list[EngineOutput], step_ms: float) -> None:
        for rid in self._pending_aborts:
            self.active.discard(rid)
            outputs.append(EngineOutput(rid, "", [], True, "abort"))
        self._pending_aborts.clear()
        if outputs:
            msg = p.StepOutputs(worker_id=self.worker_id, outputs=outputs, step_ms=step_ms)
            self._hand(pipe, msg.to_frames())

    def _hand(self, pipe: zmq.Socket, frames: list[bytes]) -> None:
        """Give a message to the IO thread (engine loop side)."""
        self._handed += 1
        pipe.send_multipart(frames)

    def _update_stats(self, now: float) -> None:
        try:
            raw = dict(self.engine.stats())
        except Exception:
            logger.exception("engine.stats() failed")
            raw = {}
        total = raw.get("num_total_blocks") or 0
        queries = raw.get("prefix_cache_queries") or 0
        window = [(t, n) for t, n in self._tokens_window if now - t <= 5.0]
        self._tokens_window = window
        span = (now - min(t for t, _ in window)) if window else 0.0  # interleaved steps first
        stats = _plain_stats(raw)
        stats.update(
            running=raw.get("num_running", 0),
            waiting=raw.get("num_waiting", 0),
            kv_usage=(1.0 - raw.get("num_free_blocks", total) / total) if total else 0.0,
            prefix_hit_rate=(raw.get("prefix_cache_hits", 0) / queries) if queries else 0.0,
            step_ms=round(self._step_ms_ema, 3),
            tokens_per_s=round(sum(n for _, n in window) / span, 1) if span > 0 else 0.0,
            preemptions=raw.get("num_preemptions", 0),
            active=len(self.active),
            steps=self.counters["steps"],
        )
        self._stats = stats

    # ------------------------------------------------------------------ IO thread

    def _io_main(self) -> None:
        try:
            IoLoop(self).run()
        except Exception:
            logger.exception("worker IO thread crashed; stopping")
            self._stop.set()
