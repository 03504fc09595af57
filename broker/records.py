"""The record link: finished-request records and worker snapshots, broker -> recorder.

The broker's DEALER sends ``RecordBatch(seq, records, edge_timings, snapshots)`` of typed items
(``broker.protocol.recorder``) to the recorder's ROUTER, which commits them and answers
``RecordAck(seq)``. The link never stalls the broker: sends are non-blocking (``IMMEDIATE``, so
nothing is queued while the recorder is down), an unacknowledged batch is resent after
``record_resend_s``, and at most ``record_retention`` items wait unacknowledged (the oldest
batches are dropped beyond that, counted in ``records_dropped``). Items are pooled for
``record_flush_s`` or ``record_batch_size`` items.

Each item is validated when it is built (as the recorder will validate it), so one bad value
cannot make a whole batch undecodable; an invalid item is counted in ``records_invalid``,
logged and left out.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from laneserve.broker import protocol as p
from laneserve.broker.requests import RequestState
from laneserve.broker.workers import WorkerState
from laneserve.contracts.latency import TIMING_FIELDS

if TYPE_CHECKING:
    from laneserve.broker.config import BrokerConfig

logger = logging.getLogger(__name__)

_NOBLOCK = zmq.NOBLOCK
_TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")
# engine counts of a final's metrics that the record carries (speculative decoding's included)
ENGINE_COUNTS = (
    "preemptions", "prefill_chunks", "spec_draft_tokens", "spec_accepted_tokens", "spec_num_drafts"
)  # fmt: skip
# The load figures a snapshot copies from the worker's heartbeat stats, and which are counts.
_SNAPSHOT_STATS = tuple(
    f.name
    for f in dataclasses.fields(p.WorkerSnapshot)
    if f.name not in ("worker_id", "at", "lanes")
)
_INT_STATS = frozenset(
    {"running", "waiting", "preemptions", "step_token_budget", "step_batch_tokens"}
)


def request_record(
    req: RequestState,
    status: str,
    finish_reason: str,
    error: tuple[str, str] | None,
    counts: dict[str, Any],
    timings: dict[str, float | None],
) -> p.RequestRecord:
    """The record of a finished request; raises ProtocolError on a value the recorder would
    refuse. ``counts``: token and engine counts by name; ``timings``: the DESIGN fields (ms)."""
    s = req.submit
    fields: dict[str, Any] = {
        "request_id": s.request_id,
        "lane": s.lane,
        "status": status,
        "finish_reason": finish_reason,
        "attempts": req.attempts,
        "arrival_at": req.arrival_at,
        "priority": s.priority,
        "model": s.model or req.worker_model,
        "worker_id": req.worker_id,
        "job_id": s.job_id,
        "custom_id": s.custom_id,
        "kind": s.task,
    }
    if error is not None:
        fields["error_code"], fields["error_message"] = error
    for key in (*_TOKEN_FIELDS, *ENGINE_COUNTS):
        fields[key] = counts.get(key)
    for key in TIMING_FIELDS:
        fields[key] = timings.get(key)
    return p.RequestRecord.checked(**fields)


def worker_snapshot(worker: WorkerState, at: float) -> p.WorkerSnapshot:
    """A snapshot of ``worker``'s last reported load at ``at`` (unix seconds); raises
    ProtocolError on a stat of the wrong type. Integral floats count as ints."""
    fields: dict[str, Any] = {"worker_id": worker.worker_id, "at": at, "lanes": list(worker.lanes)}
    for key in _SNAPSHOT_STATS:
        value = worker.stats.get(key)
        if key in _INT_STATS and type(value) is float and value.is_integer():
            value = int(value)
        fields[key] = value
    return p.WorkerSnapshot.checked(**fields)


class RecordLink:
    """Pools items, sends batches without blocking, resends until acknowledged.

    ``counters`` is the broker's counter table (``record_batches_sent``, ``records_acked``,
    ``records_dropped``, ``records_invalid``).
    """

    def __init__(
        self, ctx: zmq.Context, config: BrokerConfig, counters: collections.Counter[str]
    ) -> None:
        assert config.recorder, "RecordLink needs a recorder address"
        self.config = config
        self.counters = counters
        self.sock = ctx.socket(zmq.DEALER)
        p.secure_socket_options(self.sock)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while it is down
        self.sock.connect(config.recorder)
        self._records: list[p.RequestRecord] = []
        self._edges: list[p.EdgeTimings] = []
        self._snapshots: list[p.WorkerSnapshot] = []
        # seq -> (frames, last sent (monotonic, 0 = never), items)
        self._unacked: collections.OrderedDict[int, tuple[list[bytes], float, int]] = (
            collections.OrderedDict()
        )
        self.unacked_items = 0
        self._seq = int(time.time() * 1000) * 1000  # increasing across restarts
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.sock.close(linger=0)

    # ------------------------------------------------------------------------- items

    def add_request(self, req: RequestState, *args: Any) -> None:
        """Pool the record of a finished request (arguments of :func:`request_record`)."""
        try:
            self._records.append(request_record(req, *args))
        except p.ProtocolError as exc:
            self._refused(f"record {req.request_id[:64]!r}", exc)

    def add_edge_timings(self, msg: p.EdgeTimings) -> None:
        """Pool the edge's own TTFT/e2e of a request recorded earlier."""
        self._edges.append(msg)

    def add_snapshots(self, workers: list[WorkerState]) -> None:
        at = time.time()
        for worker in workers:
            try:
                self._snapshots.append(worker_snapshot(worker, at))
            except p.ProtocolError as exc:
                self._refused(f"snapshot of {worker.worker_id[:64]!r}", exc)

    def _refused(self, what: str, exc: p.ProtocolError) -> None:
        self.counters["records_invalid"] += 1
        logger.error("%s not recorded: %s", what, exc)

    # ------------------------------------------------------------------------- sending

    def flush(self, force: bool = False) -> None:
        """Cut pooled items into batches (when due, or ``force``) and send what is unsent."""
        now = time.monotonic()
        pending = len(self._records) + len(self._edges) + len(self._snapshots)
        due = now - self._last_flush >= self.config.record_flush_s
        if not pending or not (force or due or pending >= self.config.record_batch_size):
            return
        self._last_flush = now
        while self._records or self._edges or self._snapshots:
            self._cut_batch()
        self._enforce_retention()
        self.resend(now)

    def _cut_batch(self) -> None:
        n = self.config.record_batch_size
        records, self._records = self._records[:n], self._records[n:]
        edges, self._edges = self._edges[:n], self._edges[n:]
        snaps, self._snapshots = self._snapshots[:n], self._snapshots[n:]
        self._seq += 1
        batch = p.RecordBatch(seq=self._seq, records=records, edge_timings=edges, snapshots=snaps)
        items = batch.num_items()
        self._unacked[self._seq] = (batch.to_frames(), 0.0, items)
        self.unacked_items += items

    def _enforce_retention(self) -> None:
        while self.unacked_items > self.config.record_retention and self._unacked:
            seq, (_, _, n) = self._unacked.popitem(last=False)
            self.unacked_items -= n
            self.counters["records_dropped"] += n
            logger.error(
                "recorder backlog over %d records: dropped batch %d (%d records)",
                self.config.record_retention,
                seq,
                n,
            )

    def resend(self, now: float) -> None:
        """Send every batch never sent or unacknowledged for ``record_resend_s``."""
        for seq, (frames, sent_at, n) in self._unacked.items():
            if sent_at and now - sent_at < self.config.record_resend_s:
                continue
            try:
                self.sock.send_multipart(frames, _NOBLOCK)
            except zmq.Again:
                return  # recorder down or slow: keep them and try again later
            self._unacked[seq] = (frames, now, n)
            self.counters["record_batches_sent"] += 1

    def drain_acks(self, on_invalid: Any) -> None:
        """Read the recorder's acks; ``on_invalid(why)`` for a message that is not one."""
        for _ in range(self.config.max_reads_per_poll):
            try:
                frames = self.sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = p.decode(frames, p.RECORDER_TO_BROKER)
            except p.ProtocolError as exc:
                on_invalid(str(exc))
                continue
            entry = self._unacked.pop(ack.seq, None)
            if entry is not None:
                self.unacked_items -= entry[2]
                self.counters["records_acked"] += entry[2]
