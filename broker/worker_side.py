"""The broker's worker side: messages from workers on the back socket -- ``ready`` (register; a
restarted worker's old requests are lost), ``step_outputs`` (stream deltas or accumulate text,
finish requests, free credits), errors, and worker loss (requeue at the head of the lane, resumed
or started again, or a final ``worker_lost``; see broker/broker.py).

:class:`WorkerSide` is an object :class:`laneserve.broker.broker.Broker` holds. It is given the
broker's tables and parts it works on -- the :class:`~laneserve.broker.workers.WorkerRegistry`,
the :class:`~laneserve.broker.dispatch.Dispatcher`, the ``requests`` table, the ``counters`` and
``max_attempts`` -- and, as callables, the little it asks of the broker: ``send_back`` (a
non-blocking send on the back socket), ``send_client``, ``heartbeat_frames``, ``dispatch`` and
``finish`` (:class:`Finish`). The broker calls :meth:`WorkerSide.on_frames`,
:meth:`WorkerSide.send` and :meth:`WorkerSide.lost`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from laneserve.broker import protocol as p
from laneserve.broker.protocol.front import encode_delta

if TYPE_CHECKING:
    from laneserve.broker.dispatch import Dispatcher
    from laneserve.broker.requests import RequestState
    from laneserve.broker.workers import WorkerRegistry, WorkerState

logger = logging.getLogger(__name__)

Send = Callable[[bytes, list[bytes]], bool]  # (identity, frames) -> sent


class Finish(Protocol):
    """The broker's ``_finish``: end a request, send its final or error, record it."""

    def __call__(
        self,
        req: RequestState,
        finish_reason: str,
        error: tuple[str, str] | None,
        metrics: dict,
        *,
        status: str,
        retryable: bool = False,
    ) -> None: ...


class WorkerSide:
    """Handlers of worker messages (see the module docstring for what it is given)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        requests: dict[str, RequestState],
        counters: collections.Counter[str],
        *,
        max_attempts: int,
        send_back: Send,
        send_client: Send,
        heartbeat_frames: Callable[[], list[bytes]],
        dispatch: Callable[[], None],
        finish: Finish,
    ) -> None:
        self.registry = registry
        self.workers = registry.workers
        self.dispatcher = dispatcher
        self.requests = requests
        self.counters = counters
        self.max_attempts = max_attempts
        self._send_back = send_back
        self._send_client = send_client
        self._heartbeat_frames = heartbeat_frames
        self._dispatch = dispatch
        self._finish = finish

    def on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """One message from worker ``identity`` on the back socket (raises ProtocolError)."""
        msg = p.decode(frames, p.WORKER_TO_BROKER)
        worker = self.workers.get(identity)
        kind = type(msg)
        if kind is p.Ready:
            self._on_ready(identity, msg)
            return
        if worker is None:  # e.g. lost (partitioned) and not yet announced again
            if kind is p.StepOutputs:
                self.counters["stale_outputs"] += len(msg.outputs)  # late results: dropped
            self._on_unknown_worker(identity)
            return
        worker.last_seen = time.monotonic()
        if kind is p.StepOutputs:
            self._on_step_outputs(worker, msg)
        elif kind is p.WorkerHeartbeat:
            self.registry.on_heartbeat(worker, msg)
        elif kind is p.WorkerError:
            self._on_worker_error(worker, msg)

    def _on_unknown_worker(self, identity: bytes) -> None:
        """A message from a worker not registered (e.g. this broker restarted): tell it once
        per liveness window to forget its state and announce itself again."""
        self.counters["unknown_worker_messages"] += 1
        now = time.monotonic()
        if self.registry.may_tell_disconnect(identity, now):
            bye = p.Disconnect(reason="unknown worker").to_frames()
            if self.send(identity, bye, quiet=True):
                self.registry.told_disconnect(identity, now)

    def _on_ready(self, identity: bytes, msg: p.Ready) -> None:
        if identity in self.workers:
            self.lost(identity)  # it restarted: whatever it held is gone
        self.registry.register(identity, msg, time.monotonic())
        self.send(identity, self._heartbeat_frames())
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
                    self.send(worker.identity, p.Abort(request_id=rid).to_frames())
                continue
            if out.new_token_ids or out.new_text:
                self._on_output(req, out, now)
            if out.finished:
                self.dispatcher.release(worker, req)
                freed = True
                self._on_finished_output(req, out)
        if freed:
            self._dispatch()

    def _on_finished_output(self, req: RequestState, out: p.StepOutput) -> None:
        metrics = out.metrics or {}
        if out.finish_reason == "error" or out.error:
            error = ("engine_error", out.error or "engine error")
            self._finish(req, "error", error, metrics, status="failed")
            return
        req.embedding = out.embedding
        status = "aborted" if out.finish_reason == "abort" else "completed"
        self._finish(req, out.finish_reason or "stop", None, metrics, status=status)

    def _on_output(self, req: RequestState, out: p.StepOutput, now: float) -> None:
        req.num_tokens += len(out.new_token_ids)
        if out.new_text and not req.first_token:
            req.first_token = now
        if req.aborted:
            return
        if out.prompt_logprobs is not None:
            req.prompt_logprobs = out.prompt_logprobs
        req.token_ids.extend(out.new_token_ids)
        if req.submit.stream:
            frames = encode_delta(out.request_id, out.new_text, out.new_token_ids, out.logprobs)
            if self._send_client(req.client, frames):
                req.sent_output = True
                self.counters["deltas"] += 1
        else:
            req.text.append(out.new_text)
            if out.logprobs is not None:
                req.logprobs = (req.logprobs or []) + list(out.logprobs)

    def _on_worker_error(self, worker: WorkerState, msg: p.WorkerError) -> None:
        if msg.request_id is None:
            logger.error("worker %s error %s: %s", worker.worker_id, msg.code, msg.message[:500])
            return
        req = self.requests.get(msg.request_id)
        if req is None or req.worker != worker.identity:
            return
        self.dispatcher.release(worker, req)
        self._finish(req, "error", (msg.code, msg.message), {}, status="failed")
        self._dispatch()

    def lost(self, identity: bytes) -> None:
        """Worker ``identity`` is gone: its requests are requeued at the head of their lane
        (resumed from their output when ``resumable``, else started again), or end."""
        worker = self.registry.remove(identity)
        if worker is None:
            return
        self.counters["workers_lost"] += 1
        requeue: dict[str, list[str]] = {"interactive": [], "batch": []}
        held = [self.requests[rid] for rid in worker.in_flight if rid in self.requests]
        for req in sorted(held, key=lambda r: r.dispatched):  # the furthest along first
            rid = req.request_id
            self.dispatcher.release(worker, req)
            if req.aborted:
                self._finish(req, "abort", None, {}, status="aborted")
            elif req.attempts >= self.max_attempts:  # not retryable: it may crash every worker
                msg = f"worker lost {req.attempts} times"
                self._finish(req, "error", ("worker_lost", msg), {}, status="failed")
            elif req.sent_output and not req.resumable:
                msg = "worker lost while streaming; retry the request"
                self._finish(
                    req, "error", ("worker_lost", msg), {}, status="failed", retryable=True
                )
            else:
                self.counters["requeued"] += 1
                req.lost += 1
                if req.resumable:  # the next worker goes on from its output so far
                    self.counters["resumed"] += bool(req.token_ids)
                else:  # forget the lost attempt's partial output (stream=False accumulates it)
                    req.text, req.token_ids, req.logprobs = [], [], None
                    req.prompt_logprobs = None
                    req.num_tokens, req.first_token = 0, 0.0
                requeue[req.submit.lane].append(rid)
        self.dispatcher.requeue_at_head(requeue)  # head of the queue, original order
        self._dispatch()

    def send(self, identity: bytes, frames: list[bytes], *, quiet: bool = False) -> bool:
        """Send to worker ``identity``; a worker that cannot be reached is lost (logged unless
        ``quiet``). False when not sent."""
        if self._send_back(identity, frames):
            return True
        if not quiet and identity in self.workers:
            worker = self.workers[identity]
            if worker.draining and not worker.in_flight:  # a stop it announced: expected
                logger.info("worker %r left after draining", identity[:32])
            else:
                logger.warning("worker %r unreachable: treating as lost", identity[:32])
            self.lost(identity)
        return False
