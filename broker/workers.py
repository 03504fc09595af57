"""The worker registry: workers known by their ROUTER identity, and their liveness.

A worker announces itself with ``ready`` (lanes, capacity = its credits) and is alive while it
is heard from: a worker silent for ``liveness`` heartbeat intervals is lost. The broker sends
each worker a heartbeat every interval. An unknown identity (say, after a broker restart) is
told to ``disconnect`` (forget its state and announce again) at most once per liveness window:
a worker queues messages while the broker is away and they all arrive at once, and a second
disconnect, arriving after the worker's new ``ready``, would throw away work dispatched in
between.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from laneserve.broker import protocol as p

logger = logging.getLogger(__name__)

_MAX_TOLD = 10_000  # unknown identities remembered before the table is cleared


@dataclass(slots=True)
class WorkerState:
    """A registered worker. Times are broker ``time.monotonic()`` seconds."""

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

    @property
    def load(self) -> float:
        """Fraction of its credits in use (0..1)."""
        return len(self.in_flight) / self.capacity


class WorkerRegistry:
    """Workers by identity (``workers``), liveness deadlines and the disconnect memo.

    ``heartbeat_interval_s``: seconds between heartbeats; ``liveness``: intervals of silence
    after which a worker is lost.
    """

    def __init__(self, heartbeat_interval_s: float, liveness: int) -> None:
        self.interval_s = heartbeat_interval_s
        self.window_s = heartbeat_interval_s * liveness
        self.workers: dict[bytes, WorkerState] = {}
        self._told_disconnect: dict[bytes, float] = {}  # identity -> when told (monotonic)

    def register(self, identity: bytes, msg: p.Ready, now: float) -> WorkerState:
        """Add (or replace) the worker that sent ``ready``."""
        self._told_disconnect.pop(identity, None)
        worker = WorkerState(
            identity=identity,
            worker_id=msg.worker_id,
            pid=msg.pid,
            model=msg.model,
            lanes=tuple(msg.lanes),
            capacity=msg.capacity,
            info=msg.info,
            last_seen=now,
        )
        self.workers[identity] = worker
        logger.info(
            "worker %s ready: pid %d lanes %s capacity %d model %s",
            msg.worker_id,
            msg.pid,
            msg.lanes,
            msg.capacity,
            msg.model,
        )
        return worker

    def remove(self, identity: bytes) -> WorkerState | None:
        return self.workers.pop(identity, None)

    def on_heartbeat(self, worker: WorkerState, msg: p.WorkerHeartbeat) -> None:
        worker.stats = msg.stats
        if msg.draining and not worker.draining:
            logger.info("worker %s draining", worker.worker_id)
        worker.draining = msg.draining

    def may_tell_disconnect(self, identity: bytes, now: float) -> bool:
        """Whether an unknown ``identity`` is due a ``disconnect`` (once per liveness window)."""
        told = self._told_disconnect.get(identity)
        return told is None or now - told > self.window_s

    def told_disconnect(self, identity: bytes, now: float) -> None:
        """Remember that ``identity`` was told to disconnect at ``now``."""
        if len(self._told_disconnect) > _MAX_TOLD:
            self._told_disconnect.clear()
        self._told_disconnect[identity] = now

    def silent(self, now: float) -> list[WorkerState]:
        """Workers not heard from for the liveness window: lost."""
        return [w for w in self.workers.values() if now - w.last_seen > self.window_s]

    def heartbeat_due(self, now: float) -> list[WorkerState]:
        """Workers due a heartbeat; marks them as sent at ``now``."""
        due = [w for w in self.workers.values() if now - w.hb_sent >= self.interval_s]
        for worker in due:
            worker.hb_sent = now
        return due

    def serves(self, lane: str) -> bool:
        """Whether any registered worker serves ``lane``."""
        return any(lane in w.lanes for w in self.workers.values())

    def status(self, now: float) -> list[dict]:
        """``StatusReply.workers``: one map per worker."""
        return [
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
