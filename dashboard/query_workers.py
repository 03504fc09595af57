"""The dashboard's worker and job frames: per-worker gauges over time, lane load, the worker
table and job progress (from `worker_rows` frames and the `jobs` table; see queries.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import pandas as pd
from sqlalchemy import Engine, and_, func, or_, select

from laneserve.dashboard.query_rows import Window, _bucket, auto_bucket_s, worker_rows
from laneserve.db.models import File, Job, RetentionPass

logger = logging.getLogger(__name__)

ACTIVE_JOB_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

# ---------------------------------------------------------------------------------------------
# Workers


def _preemption_deltas(ws: pd.DataFrame) -> pd.Series:
    """Per-snapshot increase of the cumulative `preemptions` counter.

    A worker's first snapshot in the window adds 0 (its count includes earlier preemptions); a
    decrease means the worker restarted from 0, so the new value is the increase.
    """
    diff = ws.groupby("worker_id", sort=False)["preemptions"].diff()
    return diff.where(diff.isna() | (diff >= 0), ws["preemptions"]).fillna(0.0)


def worker_series(
    engine: Engine | None,
    window: Window,
    bucket_s: float | None = None,
    ws: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Worker snapshots per time bucket: means of the gauges, the sum of new preemptions.

    Columns: bucket (UTC datetime), worker_id, lanes, running, waiting, kv_usage (0..1),
    prefix_hit_rate (0..1), step_ms, tokens_per_s, preemptions (new in the bucket).
    """
    ws = worker_rows(engine, window) if ws is None else ws
    bucket_s = bucket_s or auto_bucket_s(window.seconds)
    cols = [
        "bucket", "worker_id", "lanes", "running", "waiting", "kv_usage", "prefix_hit_rate",
        "step_ms", "tokens_per_s", "preemptions",
    ]  # fmt: skip
    if ws.empty:
        return pd.DataFrame(columns=cols)
    ws = ws.assign(bucket=_bucket(ws["at"], bucket_s), new_preemptions=_preemption_deltas(ws))
    gauges = ["running", "waiting", "kv_usage", "prefix_hit_rate", "step_ms", "tokens_per_s"]
    g = ws.groupby(["bucket", "worker_id", "lanes"], sort=True)
    df = g[gauges].mean().join(g["new_preemptions"].sum().rename("preemptions")).reset_index()
    return df[cols]


def lane_load(
    engine: Engine | None,
    window: Window,
    bucket_s: float | None = None,
    ws: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Running and waiting requests per lane group over time (sums over workers of bucket means).

    A worker's snapshot counts for the lanes it serves (`lanes`, e.g. "interactive,batch"):
    worker snapshots do not split running/waiting by lane.
    Columns: bucket (UTC datetime), lanes, state ("running"/"waiting"), requests.
    """
    series = worker_series(engine, window, bucket_s, ws)
    if series.empty:
        return pd.DataFrame(columns=["bucket", "lanes", "state", "requests"])
    g = series.groupby(["bucket", "lanes"], sort=True)[["running", "waiting"]].sum().reset_index()
    return g.melt(id_vars=["bucket", "lanes"], var_name="state", value_name="requests")


def worker_summary(
    engine: Engine | None, window: Window, ws: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per worker: its latest snapshot and the preemptions during the window.

    Columns: worker_id, lanes, last_seen (UTC datetime), running, waiting, kv_usage,
    prefix_hit_rate, step_ms, tokens_per_s, preemptions (new in the window).
    """
    ws = worker_rows(engine, window) if ws is None else ws
    cols = [
        "worker_id", "lanes", "last_seen", "running", "waiting", "kv_usage", "prefix_hit_rate",
        "step_ms", "tokens_per_s", "preemptions",
    ]  # fmt: skip
    if ws.empty:
        return pd.DataFrame(columns=cols)
    ws = ws.assign(new_preemptions=_preemption_deltas(ws))
    last = ws.groupby("worker_id", sort=True).tail(1).set_index("worker_id")
    last = last.assign(
        last_seen=pd.to_datetime(last["at"], unit="s", utc=True),
        preemptions=ws.groupby("worker_id")["new_preemptions"].sum(),
    )
    return last.reset_index()[cols]


# ---------------------------------------------------------------------------------------------
# Jobs


def job_progress(
    engine: Engine, window: Window | None = None, limit: int = 20, now: float | None = None
) -> pd.DataFrame:
    """Active jobs, and jobs created in `window`, newest first, with progress and ETA.

    Columns: id, status, model, task, endpoint, input_file (the input file's name; None when
    gone), errors (the job's errors, a list of `{"code", "message"[, "line"]}`; None when none),
    total, completed, failed, done (0..1, (completed+failed)/total),
    created (UTC datetime), rate_per_s (lines finished per second since in_progress), eta_s (s;
    NaN when finished, not started, or no line finished yet), window_left_s (s until the end of
    the completion window, `expires_at - now`; negative once past, NaN when unknown).
    """
    now = time.time() if now is None else now
    cond = Job.status.in_(ACTIVE_JOB_STATUSES)
    if window is not None:
        cond = or_(cond, and_(Job.created_at >= window.start, Job.created_at < window.end))
        if window.model is not None:
            cond = and_(cond, Job.model == window.model)
    stmt = (
        select(
            Job.id,
            Job.status,
            Job.model,
            Job.task,
            Job.endpoint,
            File.filename.label("input_file"),
            Job.errors,
            Job.created_at,
            Job.in_progress_at,
            Job.request_total,
            Job.request_completed,
            Job.request_failed,
            Job.expires_at,
        )  # fmt: skip
        .outerjoin(File, File.id == Job.input_file_id)
        .where(cond)
        .order_by(Job.created_at.desc())
        .limit(limit)
    )
    with engine.connect() as conn:
        df = pd.read_sql(stmt, conn)
    df = df.rename(
        columns={
            "request_total": "total",
            "request_completed": "completed",
            "request_failed": "failed",
        }
    )
    for c in ("total", "completed", "failed"):
        df[c] = pd.to_numeric(df[c]).fillna(0).astype("int64")
    finished = df["completed"] + df["failed"]
    df["done"] = (finished / df["total"].where(df["total"] > 0)).fillna(0.0).clip(0, 1)
    elapsed = now - pd.to_numeric(df["in_progress_at"], errors="coerce").astype("float64")
    rate = finished / elapsed.where(elapsed > 0)
    df["rate_per_s"] = rate
    remaining = (df["total"] - finished).clip(lower=0)
    active = df["status"].isin(ACTIVE_JOB_STATUSES)
    df["eta_s"] = (remaining / rate.where(rate > 0)).where(active)
    df["window_left_s"] = pd.to_numeric(df["expires_at"], errors="coerce").astype("float64") - now
    df["created"] = pd.to_datetime(pd.to_numeric(df["created_at"]), unit="s", utc=True)
    df["errors"] = df["errors"].map(_json_list)  # PostgreSQL's JSON arrives parsed, SQLite's not
    cols = ["id", "status", "model", "task", "endpoint", "input_file", "errors", "total"]
    cols += ["completed", "failed", "done", "created"]
    return df[cols + ["rate_per_s", "eta_s", "window_left_s"]]


def _json_list(value: object) -> list | None:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, list) and value else None


@dataclass(frozen=True, slots=True)
class RetentionSummary:
    """The jobs runner's retention passes (`retention_passes`) and what is stored now.

    `passes` counts passes, `last_at` is the last one's unix seconds (None: no pass yet);
    `files`, `bytes`, `lines` are totals over every pass (files deleted, their bytes, job lines
    whose bodies were cleared); `stored_files`, `stored_bytes` are the files kept now.
    """

    passes: int
    last_at: float | None
    files: int
    bytes: int
    lines: int
    stored_files: int
    stored_bytes: int


def retention_summary(engine: Engine) -> RetentionSummary:
    """Totals of the retention passes and the files kept now (two small aggregate reads)."""
    passes = select(
        func.count(RetentionPass.id),
        func.max(RetentionPass.at),
        func.coalesce(func.sum(RetentionPass.files), 0),
        func.coalesce(func.sum(RetentionPass.bytes), 0),
        func.coalesce(func.sum(RetentionPass.lines), 0),
    )
    stored = select(func.count(File.id), func.coalesce(func.sum(File.bytes), 0))
    with engine.connect() as conn:
        n, last, files, size, lines = conn.execute(passes).one()
        stored_files, stored_bytes = conn.execute(stored).one()
    return RetentionSummary(
        int(n), last, int(files), int(size), int(lines), int(stored_files), int(stored_bytes)
    )
