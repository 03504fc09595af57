"""Dispatch: the two lane queues, credits, the batch share and solo reservations.

Each lane's queue is ordered by the submit's ``priority`` (lower = more urgent), then by arrival
at the broker; requests of a lost worker go back to the head. Order between lanes: interactive
first whenever a worker serving it has credit; batch fills the rest, and
after ``batch_every`` consecutive interactive dispatches a waiting batch request goes first (the
minimum batch share, so batch never starves). On a worker serving both lanes, batch may use at
most ``capacity - interactive_reserve`` credits so an interactive arrival can always be sent to
the engine (which then preempts batch work, DESIGN.md "Lanes"). A worker never holds more
requests than the ``capacity`` it declared.

Solo attempts: a request lost with its worker before, about to get its last attempt, runs
*alone* on a worker. One worker is reserved for it (it takes nothing new, so it empties even
under steady traffic) and the request goes there once the worker is empty. One reservation at
a time; other solo requests wait their turn at the head of their queue.
"""

from __future__ import annotations

import bisect
import collections
from typing import TYPE_CHECKING

from laneserve.broker import protocol as p
from laneserve.broker.requests import RequestState
from laneserve.broker.workers import WorkerState

if TYPE_CHECKING:
    from laneserve.broker.config import BrokerConfig

LANE_NAMES = ("interactive", "batch")


class Dispatcher:
    """Queues of request ids per lane and the choice of the next (worker, request) pair.

    ``workers`` and ``requests`` are the broker's own tables (shared, not copied).
    """

    def __init__(
        self,
        config: BrokerConfig,
        workers: dict[bytes, WorkerState],
        requests: dict[str, RequestState],
        counters: collections.Counter[str],
    ) -> None:
        self.config = config
        self.workers = workers
        self.requests = requests
        self.counters = counters
        self.queues: dict[str, collections.deque[str]] = {
            lane: collections.deque() for lane in LANE_NAMES
        }
        self._since_batch = 0  # interactive dispatches since the last batch one
        self._reserved: tuple[bytes, str] | None = None  # (worker, request) of a solo attempt

    # ------------------------------------------------------------------------- queues

    def limit(self, lane: str) -> int:
        """Queue bound of ``lane`` (interactive full -> ``overloaded``)."""
        if lane == "interactive":
            return self.config.max_interactive_queue
        return self.config.max_batch_queue

    def refusal(self, msg: p.Submit) -> p.Error | None:
        """The ``overloaded`` error (retryable, HTTP 429 at the gateway) for a submit whose lane
        queue is full; None when it may be queued."""
        limit = self.limit(msg.lane)
        if len(self.queues[msg.lane]) < limit:
            return None
        return p.Error(
            request_id=msg.request_id,
            code="overloaded",
            message=f"{msg.lane} queue is full ({limit})",
            retryable=True,
        )

    def depths(self) -> dict[str, int]:
        """Waiting requests per lane."""
        return {lane: len(q) for lane, q in self.queues.items()}

    def _queue_key(self, rid: str) -> tuple[int, float]:
        req = self.requests[rid]
        return req.submit.priority, req.received

    def enqueue(self, req: RequestState) -> None:
        """Queue ``req`` behind every request of its lane with a more or equally urgent
        ``priority`` (equal priorities keep arrival order)."""
        queue = self.queues[req.lane]
        key = (req.submit.priority, req.received)
        if not queue or self._queue_key(queue[-1]) <= key:  # the common case: append
            queue.append(req.request_id)
            return
        pos = bisect.bisect_right(queue, key, key=self._queue_key)
        queue.insert(pos, req.request_id)

    def remove(self, req: RequestState) -> None:
        """Take a waiting request out of its queue (it may already be gone)."""
        try:
            self.queues[req.lane].remove(req.request_id)
        except ValueError:
            pass

    def requeue_at_head(self, requeue: dict[str, list[str]]) -> None:
        """Put request ids back at the head of their lane's queue, in their given order."""
        for lane, rids in requeue.items():
            self.queues[lane].extendleft(reversed(rids))

    def expire_no_worker(self, now: float, serves_interactive: bool) -> list[RequestState]:
        """Interactive requests that waited ``no_worker_timeout_s`` with no worker serving
        the lane, taken out of the queue (oldest first)."""
        queue = self.queues["interactive"]
        if serves_interactive or not queue:
            return []
        limit = self.config.no_worker_timeout_s
        expired = [self.requests[rid] for rid in queue]
        expired = sorted(
            (r for r in expired if now - r.received >= limit), key=lambda r: r.received
        )
        for req in expired:
            queue.remove(req.request_id)
        return expired

    # ------------------------------------------------------------------------- choice

    def next(self) -> tuple[WorkerState, RequestState] | None:
        """The next request to send and its worker, taken off its queue; None when nothing
        can be dispatched now (empty queues or no credit)."""
        inter, batch = self.queues["interactive"], self.queues["batch"]
        order = ["interactive", "batch"]
        if batch and (not inter or self._since_batch >= self.config.batch_every):
            order = ["batch", "interactive"]
        for lane in order:
            if not self.queues[lane]:
                continue
            worker = self._pick(lane)
            if worker is None:
                continue
            rid = self.queues[lane].popleft()
            if lane == "batch":
                self._since_batch = 0
            elif batch:
                self._since_batch += 1
            return worker, self.requests[rid]
        return None

    def needs_solo(self, req: RequestState) -> bool:
        """A request lost with a worker before, about to get its last attempt."""
        return req.lost > 0 and req.attempts + 1 >= self.config.max_attempts

    def _pick(self, lane: str) -> WorkerState | None:
        """The least-loaded worker that may take the head of ``lane``'s queue (non-empty)."""
        head = self.requests[self.queues[lane][0]]
        if self.needs_solo(head):
            return self._pick_solo(lane, head.request_id)
        best, best_load = None, 2.0
        for worker in self.workers.values():
            if self._may_take(worker, lane) and worker.load < best_load:
                best, best_load = worker, worker.load
        return best

    def _may_take(self, worker: WorkerState, lane: str) -> bool:
        if lane not in worker.lanes or worker.draining or worker.credit <= 0 or worker.solo:
            return False
        if lane == "batch" and len(worker.lanes) > 1:
            reserve = max(1, int(worker.capacity * self.config.interactive_reserve_fraction))
            return worker.num_batch < max(1, worker.capacity - reserve)
        return True

    def _pick_solo(self, lane: str, rid: str) -> WorkerState | None:
        """The reserved worker for the solo attempt of ``rid`` once it is empty; reserves
        the least-loaded worker of ``lane`` when no reservation is held."""
        self._drop_stale_reservation()
        if self._reserved is None:
            candidates = [
                w
                for w in self.workers.values()
                if lane in w.lanes and not w.draining and not w.solo
            ]
            if not candidates:
                return None
            worker = min(candidates, key=lambda w: w.load)
            worker.solo = True
            self._reserved = (worker.identity, rid)
        identity, owner = self._reserved
        worker = self.workers[identity]
        if owner != rid or worker.in_flight or lane not in worker.lanes:
            return None
        return worker

    def _drop_stale_reservation(self) -> None:
        """Release a reservation whose worker or request moved on (gone, draining,
        dispatched, no longer at the head of its queue)."""
        if self._reserved is None:
            return
        identity, rid = self._reserved
        worker = self.workers.get(identity)
        req = self.requests.get(rid)
        queue = self.queues[req.lane] if req is not None else None
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

    # ------------------------------------------------------------------------- credits

    def assign(self, worker: WorkerState, req: RequestState, now: float) -> None:
        """Book ``req`` on ``worker``: one credit, one attempt, and the solo flags."""
        req.worker = worker.identity
        req.worker_id = worker.worker_id
        req.worker_model = worker.model or None
        req.dispatched = now
        if self.needs_solo(req):
            req.solo = worker.solo = True
            self._reserved = None
            self.counters["solo_dispatches"] += 1
        req.attempts += 1
        worker.in_flight.add(req.request_id)
        if req.lane == "batch":
            worker.num_batch += 1

    def release(self, worker: WorkerState, req: RequestState) -> None:
        """Give ``req``'s credit on ``worker`` back (finished, failed or lost)."""
        rid = req.request_id
        if rid in worker.in_flight:
            worker.in_flight.discard(rid)
            if req.lane == "batch":
                worker.num_batch -= 1
            if req.solo:
                req.solo = worker.solo = False
        req.worker = None
