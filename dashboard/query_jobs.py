"""One bulk job's figures for the per-job view: headline numbers (`jobs.stats.batch_stats`, the
same figures `GET /v1/batches/{id}/stats` serves), its completion window, its lines' rows and
its first error lines with their codes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
from sqlalchemy import Engine, select

from laneserve.db.models import Job, Request
from laneserve.jobs.stats import BatchStats, batch_stats

# Line statuses that carry no error (the rest, once answered, are error lines).
_OK_STATUSES = ("completed", "pending", "in_progress")


@dataclass(frozen=True, slots=True)
class JobView:
    """`stats` of the job plus its completion window: `completion_window` as submitted ("24h"),
    `expires_at` (unix seconds), `window_left_s` (s left at `now`; negative once past)."""

    stats: BatchStats
    completion_window: str | None
    expires_at: float | None
    window_left_s: float | None


def job_view(engine: Engine, job_id: str, now: float | None = None) -> JobView | None:
    """The job's figures, or None when there is no such job."""
    now = time.time() if now is None else now
    with engine.connect() as conn:
        row = conn.execute(
            select(Job.completion_window, Job.expires_at).where(Job.id == job_id)
        ).one_or_none()
    if row is None:
        return None
    stats = batch_stats(engine, job_id, now=now)
    left = None if row.expires_at is None else float(row.expires_at) - now
    return JobView(stats, row.completion_window, row.expires_at, left)


def job_ids(engine: Engine, limit: int = 50) -> list[str]:
    """The newest jobs' ids, newest first."""
    with engine.connect() as conn:
        stmt = select(Job.id).order_by(Job.created_at.desc()).limit(limit)
        return list(conn.execute(stmt).scalars())


def job_errors(engine: Engine, job_id: str, n: int = 10) -> pd.DataFrame:
    """The job's first `n` error lines by line number.

    Columns: line (1-based input line), custom_id, code, message, attempts. The code and message
    come from the stored error response (`{"error": {"code", "message"[, "attempts"]}}`), else
    from the row's `error` text.
    """
    stmt = (
        select(Request.line_no, Request.custom_id, Request.response, Request.error)
        .where(
            Request.job_id == job_id,
            Request.status.not_in(_OK_STATUSES),
            Request.response.is_not(None) | Request.error.is_not(None),
        )
        .order_by(Request.line_no)
        .limit(n)
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    out = []
    for line_no, custom_id, response, error in rows:
        err = (response or {}).get("error") or {}
        code = err.get("code") or (error or "").split(":", 1)[0] or None
        out.append((line_no, custom_id, code, err.get("message") or error, err.get("attempts")))
    return pd.DataFrame(out, columns=["line", "custom_id", "code", "message", "attempts"])
