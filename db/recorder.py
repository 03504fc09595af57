"""The recorder: writes finished-request records and worker snapshots to SQL in batches.

Data flow (DESIGN.md "Processes and data flow", docs/interfaces.md "Records to SQL"): the
broker's DEALER sends `broker.protocol.RecordBatch(seq, records, edge_timings, snapshots)` of
typed items to the recorder's ROUTER at `recorder_addr`; the recorder maps them onto rows
(`request_row`, `edge_row`, `snapshot_row`: the only place that knows the column names), writes
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
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, and_, delete, or_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from contracts.latency import TIMING_FIELDS
from contracts.procs import parent_gone
from db.models import REQUEST_COLUMNS, WORKER_STAT_COLUMNS, Request, WorkerStat
from db.session import writer

if TYPE_CHECKING:
    from broker.protocol import EdgeTimings, RecordBatch, RequestRecord, WorkerSnapshot

logger = logging.getLogger(__name__)

# Pool at most this long before writing (s); DESIGN.md asks for commits within about 1 s.
FLUSH_INTERVAL_S = 0.2
# Write as soon as this many records + snapshots are pooled.
MAX_PENDING_RECORDS = 5_000
# Seconds to wait before retrying after a transient database error.
RETRY_BACKOFF_S = 0.5
# Default retention of API request rows and worker snapshots (DESIGN.md "Retention").
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
PRUNE_EVERY_S = 3600.0
STATS_LOG_EVERY_S = 60.0


class RecordError(ValueError):
    """A record or snapshot that cannot be written (missing key, wrong type)."""


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


@dataclass(slots=True)
class WriteResult:
    """Outcome of one `write_batch`: rows written and items that could not be written."""

    records_written: int = 0
    snapshots_written: int = 0
    records_failed: int = 0
    snapshots_failed: int = 0
    errors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Normalization: the same type rules on SQLite (lax) and PostgreSQL (strict).

_INT, _FLOAT, _STR, _JSON = "int", "float", "str", "json"


def _kinds(table) -> dict[str, str]:
    """Column name -> the value kind a record may carry for it."""
    out = {}
    for col in table.columns:
        if col.name in ("body", "response"):
            out[col.name] = _JSON
        else:
            out[col.name] = {int: _INT, float: _FLOAT}.get(col.type.python_type, _STR)
    return out


_REQUEST_KINDS = _kinds(Request.__table__)
_SNAPSHOT_KINDS = _kinds(WorkerStat.__table__)
_NOT_NULL_REQUEST = {"lane", "priority", "attempts"}


def _coerce(name: str, kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == _INT and type(value) is int:
        return value
    if kind == _INT and type(value) is float and value.is_integer():
        return int(value)
    if kind == _FLOAT and type(value) in (int, float):
        if not math.isfinite(value):
            raise RecordError(f"{name}={value!r} is not finite")
        return float(value)
    if kind == _STR and isinstance(value, str):
        return value
    if kind == _JSON and isinstance(value, dict | list):
        return value
    raise RecordError(f"{name}: expected {kind}, got {type(value).__name__}")


def normalize_record(record: dict[str, Any]) -> dict[str, Any]:
    """A `requests` row from a record dict: known columns only, types checked.

    Unknown keys are ignored; a None `lane`/`priority`/`attempts` is dropped (column default).

    Raises:
        RecordError: no string `id`, or a value of the wrong type.
    """
    if not isinstance(record.get("id"), str) or not record["id"]:
        raise RecordError("record without a string 'id'")
    row = {}
    for key, value in record.items():
        if key not in REQUEST_COLUMNS:
            continue
        if value is None and key in _NOT_NULL_REQUEST:
            continue
        row[key] = _coerce(key, _REQUEST_KINDS[key], value)
    return row


def normalize_snapshot(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A `worker_stats` row from a snapshot dict; a `lanes` list is comma-joined.

    Raises:
        RecordError: no string `worker_id`, no numeric `at`, or a value of the wrong type.
    """
    snap = dict(snapshot)
    if isinstance(snap.get("lanes"), list | tuple):
        snap["lanes"] = ",".join(str(lane) for lane in snap["lanes"])
    if not isinstance(snap.get("worker_id"), str) or snap.get("at") is None:
        raise RecordError("snapshot without 'worker_id' and 'at'")
    return {
        k: _coerce(k, _SNAPSHOT_KINDS[k], v) for k, v in snap.items() if k in WORKER_STAT_COLUMNS
    }


# --------------------------------------------------------------------------------------------
# Typed records (broker.protocol.recorder) -> rows.


def request_row(rec: RequestRecord) -> dict[str, Any]:
    """The `requests` row of a `RequestRecord`: its fields, `error` as "code: message", and
    the display timestamps `first_scheduled_at`, `first_token_at`, `finished_at` (unix s) as
    `arrival_at` plus `queue_ms`, `ttft_ms`, `e2e_ms`. `job_id`/`custom_id` only when set:
    the jobs runner owns those columns of a job line's row."""

    def at(ms: float | None) -> float | None:
        return None if ms is None else rec.arrival_at + ms / 1000.0

    row = {name: getattr(rec, name) for name in _RECORD_COLUMNS}
    row["id"] = rec.request_id
    row["error"] = None if rec.error_code is None else f"{rec.error_code}: {rec.error_message}"
    row["first_scheduled_at"] = at(rec.queue_ms)
    row["first_token_at"] = at(rec.ttft_ms)
    row["finished_at"] = at(rec.e2e_ms)
    for key in ("job_id", "custom_id"):
        if getattr(rec, key) is not None:
            row[key] = getattr(rec, key)
    return row


def edge_row(msg: EdgeTimings) -> dict[str, Any]:
    """The partial `requests` row of an `EdgeTimings`: only the fields it carries are updated."""
    row = {"id": msg.request_id, "ttft_ms": msg.ttft_ms, "e2e_ms": msg.e2e_ms}
    return {k: v for k, v in row.items() if v is not None}


def snapshot_row(snap: WorkerSnapshot) -> dict[str, Any]:
    """The `worker_stats` row of a `WorkerSnapshot`: every field is the column of its name,
    `lanes` comma-joined."""
    return snap.payload() | {"lanes": ",".join(snap.lanes)}


def batch_rows(batches: Iterable[RecordBatch]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(request rows, snapshot rows) of `RecordBatch` messages, in order: within a batch the
    records come before the edge timings that refine them."""
    requests: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    for batch in batches:
        requests += [request_row(r) for r in batch.records]
        requests += [edge_row(e) for e in batch.edge_timings]
        snapshots += [snapshot_row(s) for s in batch.snapshots]
    return requests, snapshots


_RECORD_COLUMNS = (
    "lane",
    "priority",
    "model",
    "worker_id",
    "status",
    "finish_reason",
    "attempts",
    "arrival_at",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "preemptions",
    "prefill_chunks",
    *TIMING_FIELDS,
)


def _merge_by_key(rows: Iterable[dict[str, Any]], key) -> list[dict[str, Any]]:
    """Merge rows with the same key (later values win) so one statement touches a row once."""
    merged: dict[Any, dict[str, Any]] = {}
    for row in rows:
        merged.setdefault(key(row), {}).update(row)
    return list(merged.values())


# --------------------------------------------------------------------------------------------
# SQL writes.


def _insert(conn: Connection, table):
    return (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)


def _upsert_requests(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted(row)), []).append(row)
    table = Request.__table__
    for keys, group in groups.items():
        stmt = _insert(conn, table)
        updates = {k: stmt.excluded[k] for k in keys if k != "id"}
        if updates:
            stmt = stmt.on_conflict_do_update(index_elements=["id"], set_=updates)
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=["id"])
        conn.execute(stmt, group)


def _upsert_request_one(conn: Connection, row: dict[str, Any]) -> None:
    """One record; a job line whose (job_id, custom_id) row exists under another id is
    updated in place (its id is kept)."""
    try:
        with conn.begin_nested():
            _upsert_requests(conn, [row])
    except IntegrityError:
        if row.get("job_id") is None or row.get("custom_id") is None:
            raise
        table = Request.__table__
        values = {k: v for k, v in row.items() if k != "id"}
        where = and_(table.c.job_id == row["job_id"], table.c.custom_id == row["custom_id"])
        with conn.begin_nested():
            if conn.execute(update(table).where(where).values(values)).rowcount != 1:
                raise


def _insert_snapshots(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted(row)), []).append(row)
    for group in groups.values():
        stmt = _insert(conn, WorkerStat.__table__).on_conflict_do_nothing(
            index_elements=["worker_id", "at"]
        )
        conn.execute(stmt, group)


def write_batch(
    engine: Engine, records: Sequence[dict[str, Any]], snapshots: Sequence[dict[str, Any]]
) -> WriteResult:
    """Write records and snapshots in one transaction; returns what was written and failed.

    Invalid items are counted in the result and skipped. If the bulk statement fails on a
    constraint, items are retried one by one under savepoints so only the bad ones fail.

    Raises:
        OperationalError (or another DBAPIError that is not an integrity/data error): the
            database is unavailable or locked; nothing was committed, retry later.
    """
    result = WriteResult()
    req_rows, snap_rows = [], []
    for rec in records:
        try:
            req_rows.append(normalize_record(rec))
        except RecordError as exc:
            result.records_failed += 1
            result.errors.append(f"record {str(rec.get('id'))[:64]!r}: {exc}")
    for snap in snapshots:
        try:
            snap_rows.append(normalize_snapshot(snap))
        except RecordError as exc:
            result.snapshots_failed += 1
            result.errors.append(f"snapshot: {exc}")
    req_rows = _merge_by_key(req_rows, lambda r: r["id"])
    snap_rows = _merge_by_key(snap_rows, lambda r: (r["worker_id"], r["at"]))
    if not req_rows and not snap_rows:
        return result
    with writer(engine).begin() as conn:
        try:
            with conn.begin_nested():
                if req_rows:
                    _upsert_requests(conn, req_rows)
                if snap_rows:
                    _insert_snapshots(conn, snap_rows)
            result.records_written += len(req_rows)
            result.snapshots_written += len(snap_rows)
        except OperationalError:
            raise
        except DBAPIError as bulk_exc:
            logger.info("bulk write failed (%s); writing one by one", type(bulk_exc).__name__)
            _write_one_by_one(conn, req_rows, snap_rows, result)
    return result


def _write_one_by_one(
    conn: Connection,
    req_rows: Sequence[dict[str, Any]],
    snap_rows: Sequence[dict[str, Any]],
    result: WriteResult,
) -> None:
    for row in req_rows:
        try:
            _upsert_request_one(conn, row)
            result.records_written += 1
        except OperationalError:
            raise
        except DBAPIError as exc:
            result.records_failed += 1
            result.errors.append(f"record {row['id'][:64]!r}: {str(exc.orig)[:200]}")
    for row in snap_rows:
        try:
            with conn.begin_nested():
                _insert_snapshots(conn, [row])
            result.snapshots_written += 1
        except OperationalError:
            raise
        except DBAPIError as exc:
            result.snapshots_failed += 1
            result.errors.append(f"snapshot {row['worker_id'][:64]!r}: {str(exc.orig)[:200]}")


def prune(
    engine: Engine, older_than: float, *, now: float | None = None, include_job_lines: bool = False
) -> tuple[int, int]:
    """Delete request rows and worker snapshots older than `older_than` seconds.

    A request's age is taken from `finished_at` (or `arrival_at` when unfinished); job lines
    (`job_id` set) belong to their job and are kept unless `include_job_lines`. `now` is unix
    seconds (default: `time.time()`).

    Returns:
        (requests deleted, snapshots deleted).

    Raises:
        ValueError: `older_than` negative or not finite.
    """
    if not math.isfinite(older_than) or older_than < 0:
        raise ValueError(f"older_than={older_than} must be a non-negative number of seconds")
    cutoff = (time.time() if now is None else now) - older_than
    req = Request.__table__
    age = or_(
        req.c.finished_at < cutoff, and_(req.c.finished_at.is_(None), req.c.arrival_at < cutoff)
    )
    if not include_job_lines:
        age = and_(age, req.c.job_id.is_(None))
    with writer(engine).begin() as conn:
        n_req = conn.execute(delete(req).where(age)).rowcount
        n_snap = conn.execute(
            delete(WorkerStat.__table__).where(WorkerStat.__table__.c.at < cutoff)
        ).rowcount
    return n_req, n_snap


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

        from broker.protocol import secure_socket_options

        self.addr = addr
        self.engine = engine
        self.parent_pid = parent_pid
        self.flush_interval_s = flush_interval_s
        self.max_pending_records = max_pending_records
        self.retention_s = retention_s
        self.stats = RecorderStats()
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

        from broker.protocol import BROKER_TO_RECORDER, ProtocolError, decode

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
            # Transient (locked, unreachable): no ack, the broker resends these batches.
            self.stats.transient_errors += 1
            logger.warning(
                "write of %d batches failed, not acknowledged: %s", len(pending), exc.orig
            )
            time.sleep(RETRY_BACKOFF_S)
            return
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

        from broker.protocol import RecordAck

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
