"""The recorder: writes finished-request records and worker snapshots to SQL in batches.

Data flow (DESIGN.md "Processes and data flow", docs/interfaces.md "Records to SQL"): the
broker's DEALER sends `broker.protocol.RecordBatch(seq, records, edge_timings, snapshots)` of
typed items to the recorder's ROUTER at `recorder_addr`; the recorder maps them onto rows
(`db.record_rows`: the only place that knows the column names), writes (`db.record_writes`)
the batch and answers `RecordAck(seq)` **only after the commit**. The broker keeps
unacknowledged batches and resends them, so:

- writes are idempotent: a record is an insert-or-update on `requests.id` (only the columns the
  record carries are updated, so a job line's `body` written by the jobs runner survives); a
  snapshot is insert-or-ignore on (`worker_id`, `at`);
- a batch whose transaction fails for a transient reason (database locked or unreachable) is
  not acknowledged and is resent by the broker;
- a record that can never be written (wrong types, a constraint violation) is counted in
  `RecorderStats.records_failed`, logged, and the rest of its batch is still written and
  acknowledged.

Batching: messages are pooled for at most `flush_interval_s` (default 0.2 s, well inside the
"commits within about a second" of DESIGN.md "Storage") or `max_pending_records`, then written
in one short transaction. On SIGTERM (or when the parent process dies) the pool is flushed
before exit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from laneserve.contracts.procs import parent_gone
from laneserve.db.availability import Outage
from laneserve.db.record_rows import batch_rows
from laneserve.db.record_writes import prune, write_batch

logger = logging.getLogger(__name__)

# Pool at most this long before writing (s); DESIGN.md asks for commits within about 1 s.
FLUSH_INTERVAL_S = 0.2
# Write as soon as this many records + snapshots are pooled.
MAX_PENDING_RECORDS = 5_000
# Seconds to wait before retrying after a transient database error: doubling from the first
# to the second while the database stays away (db.availability.Outage).
RETRY_BACKOFF_S = (0.5, 5.0)
# Default retention of API request rows and worker snapshots (DESIGN.md "Retention").
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
PRUNE_EVERY_S = 3600.0
STATS_LOG_EVERY_S = 60.0


@dataclass(slots=True)
class RecorderStats:
    """Counters since start-up (all counts)."""

    batches: int = 0
    records_written: int = 0
    snapshots_written: int = 0
    records_failed: int = 0
    snapshots_failed: int = 0
    invalid_messages: int = 0
    transient_errors: int = 0


# --------------------------------------------------------------------------------------------
# The process: a ZMQ ROUTER in front of write_batch.


class RecorderServer:
    """Binds a ROUTER at `addr`, pools `RecordBatch` messages, writes, then acks.

    `run()` returns when `stop()` is called (e.g. from a SIGTERM handler), or when
    `contracts.procs.parent_gone(parent_pid)` says the parent is gone; pooled batches are flushed
    first. Counters are in `stats`.
    """

    def __init__(
        self,
        addr: str,
        engine: Engine,
        *,
        parent_pid: int | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_pending_records: int = MAX_PENDING_RECORDS,
        retention_s: float = DEFAULT_RETENTION_S,
    ) -> None:
        import zmq

        from laneserve.broker.protocol import secure_socket_options

        self.addr = addr
        self.engine = engine
        self.parent_pid = parent_pid
        self.flush_interval_s = flush_interval_s
        self.max_pending_records = max_pending_records
        self.retention_s = retention_s
        self.stats = RecorderStats()
        self.outage = Outage(
            "writes wait; the broker keeps and resends the batches", logger, RETRY_BACKOFF_S
        )
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        secure_socket_options(self._sock, router=True)
        self._sock.bind(addr)
        self.bound_addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pending: list[tuple[bytes, Any]] = []  # (peer identity, RecordBatch)
        self._pending_items = 0
        self._first_pending_at = 0.0
        self._last_prune = 0.0
        self._last_stats_log = time.monotonic()
        self._logged_stats = RecorderStats()

    def stop(self) -> None:
        """Ask `run()` to flush and return (thread- and signal-safe)."""
        self._stop.set()

    def _parent_gone(self) -> bool:
        return parent_gone(self.parent_pid)

    def run(self) -> RecorderStats:
        """Serve until stopped; returns the final counters."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        logger.info("recorder listening on %s", self.bound_addr)
        try:
            while not self._stop.is_set():
                if self._parent_gone():
                    logger.info("parent %s is gone; recorder exiting", self.parent_pid)
                    break
                if poller.poll(50):
                    self._receive_all()
                if self._pending and (
                    self._pending_items >= self.max_pending_records
                    or time.monotonic() - self._first_pending_at >= self.flush_interval_s
                ):
                    self._flush()
                self._maybe_prune()
                self._maybe_log_stats()
            self._receive_all()
            self._flush()
        finally:
            self._sock.close(linger=0)
            self._ctx.term()
        logger.info("recorder stopped: %s", self.stats)
        return self.stats

    def _receive_all(self) -> None:
        import zmq

        from laneserve.broker.protocol import BROKER_TO_RECORDER, ProtocolError, decode

        while self._pending_items < self.max_pending_records:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                batch = decode(body, BROKER_TO_RECORDER)
            except ProtocolError as exc:
                self.stats.invalid_messages += 1
                logger.warning("dropped an invalid message: %s", exc)
                continue
            if not self._pending:
                self._first_pending_at = time.monotonic()
            self._pending.append((identity, batch))
            self._pending_items += batch.num_items()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_items = self._pending, [], 0
        records, snapshots = batch_rows(b for _, b in pending)
        try:
            result = write_batch(self.engine, records, snapshots)
        except DBAPIError as exc:
            # Transient (locked, unreachable): no ack; the broker keeps these batches in its
            # bounded buffer and resends them. Retries back off while the database is away.
            self.stats.transient_errors += 1
            delay = self.outage.failed(exc)
            logger.info("write of %d batches failed, not acknowledged: %s", len(pending), exc.orig)
            self._stop.wait(delay)
            return
        self.outage.ok()
        self.stats.batches += len(pending)
        self.stats.records_written += result.records_written
        self.stats.snapshots_written += result.snapshots_written
        self.stats.records_failed += result.records_failed
        self.stats.snapshots_failed += result.snapshots_failed
        for err in result.errors[:10]:
            logger.warning("not written: %s", err)
        self._ack(pending)

    def _ack(self, pending: Sequence[tuple[bytes, Any]]) -> None:
        import zmq

        from laneserve.broker.protocol import RecordAck

        for identity, batch in pending:
            try:
                self._sock.send_multipart(
                    [identity, *RecordAck(seq=batch.seq).to_frames()], zmq.NOBLOCK
                )
            except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
                logger.info("ack %d to a vanished peer dropped: %s", batch.seq, exc)

    def _maybe_log_stats(self) -> None:
        if time.monotonic() - self._last_stats_log < STATS_LOG_EVERY_S:
            return
        self._last_stats_log = time.monotonic()
        if self.stats != self._logged_stats:
            logger.info("recorder: %s", self.stats)
            self._logged_stats = dataclasses.replace(self.stats)

    def _maybe_prune(self) -> None:
        if self.retention_s <= 0 or time.monotonic() - self._last_prune < PRUNE_EVERY_S:
            return
        self._last_prune = time.monotonic()
        try:
            n_req, n_snap = prune(self.engine, self.retention_s)
        except DBAPIError as exc:
            logger.warning("retention prune failed: %s", exc.orig)
            return
        if n_req or n_snap:
            logger.info("pruned %d requests and %d snapshots", n_req, n_snap)
