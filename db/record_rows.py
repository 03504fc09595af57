"""Records to rows: the only place that knows the SQL column names of `requests` and
`worker_stats` (the recorder's side of docs/interfaces.md "Records to SQL").

- `request_row`, `edge_row`, `snapshot_row`, `batch_rows`: typed `broker.protocol` records ->
  row dicts keyed by column name;
- `normalize_record`, `normalize_snapshot`: the same type rules on SQLite (lax) and PostgreSQL
  (strict); a value that can never be written raises `RecordError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from laneserve.contracts.latency import TIMING_FIELDS
from laneserve.db.models import REQUEST_COLUMNS, WORKER_STAT_COLUMNS, Request, WorkerStat

if TYPE_CHECKING:
    from laneserve.broker.protocol import EdgeTimings, RecordBatch, RequestRecord, WorkerSnapshot

logger = logging.getLogger(__name__)


class RecordError(ValueError):
    """A record or snapshot that cannot be written (missing key, wrong type)."""


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
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_num_drafts",
    "kind",
    *TIMING_FIELDS,
)
