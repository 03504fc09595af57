"""Writing rows: `write_batch` (idempotent insert-or-update of request rows, insert-or-ignore
of snapshots, one short transaction; a row that can never be written is counted, not fatal)
and `prune` (retention of API request rows and worker snapshots).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, or_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from laneserve.db.models import Request, WorkerStat
from laneserve.db.record_rows import RecordError, normalize_record, normalize_snapshot
from laneserve.db.session import writer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteResult:
    """Outcome of one `write_batch`: rows written and items that could not be written."""

    records_written: int = 0
    snapshots_written: int = 0
    records_failed: int = 0
    snapshots_failed: int = 0
    errors: list[str] = field(default_factory=list)


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


def _merge_by_key(rows: Iterable[dict[str, Any]], key) -> list[dict[str, Any]]:
    """Merge rows with the same key (later values win) so one statement touches a row once."""
    merged: dict[Any, dict[str, Any]] = {}
    for row in rows:
        merged.setdefault(key(row), {}).update(row)
    return list(merged.values())


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
