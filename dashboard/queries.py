"""The dashboard's SQL: plain functions that take an Engine and a `Window`, return pandas DataFrames.

SQL only selects rows (a time window, a lane, a model); every aggregate — percentiles, histograms,
rates — is computed here in numpy/pandas, so SQLite and PostgreSQL give the same answer.
Percentiles use the one rule of `contracts.latency.percentile` (numpy's default, Hyndman & Fan
definition 7). Time buckets are `floor(t / bucket_s) * bucket_s` over `requests.finished_at` /
`worker_stats.at` (unix seconds; display only — durations come from the `*_ms` columns).

Functions that take `rows=` (a `request_rows` frame) or `ws=` (a `worker_rows` frame) read nothing
when it is given (`engine` may then be None), so one dashboard refresh reads each table once.

No Streamlit here; `dashboard/app.py` only lays these frames out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from sqlalchemy import Engine, and_, func, or_, select

from contracts.latency import percentile
from dashboard.diagnose import Figures
from db.models import Job, Request, WorkerStat

logger = logging.getLogger(__name__)

# Per-phase latency fields of DESIGN.md, in display order; label -> column.
PHASES: dict[str, str] = {
    "TTFT": "ttft_ms",
    "TPOT": "tpot_ms",
    "queue": "queue_ms",
    "prefill": "prefill_ms",
    "decode": "decode_ms",
    "e2e": "e2e_ms",
}
PERCENTILES: tuple[int, ...] = (50, 90, 99)
LANES: tuple[str, ...] = ("interactive", "batch")
# Bucket sizes (s) the auto bucket picks from, so that a window shows ~60 points.
_NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
_TIMEOUT_MARKERS = ("deadline_exceeded", "timeout", "timed out")
_ACTIVE_JOB_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class QueryError(ValueError):
    """A query was asked something it cannot answer (unknown metric, empty/inverted window)."""


@dataclass(frozen=True, slots=True)
class Window:
    """What the dashboard looks at: `[start, end)` in unix seconds, optionally one lane/model.

    Raises:
        QueryError: `end <= start`, or a lane other than interactive/batch.
    """

    start: float
    end: float
    lane: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.end > self.start:
            raise QueryError(f"empty window: end {self.end} <= start {self.start}")
        if self.lane is not None and self.lane not in LANES:
            raise QueryError(f"unknown lane {self.lane!r}; expected one of {LANES}")

    @classmethod
    def last(
        cls,
        seconds: float,
        lane: str | None = None,
        model: str | None = None,
        now: float | None = None,
    ) -> Window:
        """The window of the last `seconds` up to `now` (default `time.time()`)."""
        end = time.time() if now is None else now
        return cls(end - seconds, end, lane, model)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def auto_bucket_s(window_s: float, points: int = 60) -> int:
    """The smallest "nice" bucket size (s) that splits `window_s` into at most `points` buckets."""
    for b in _NICE_BUCKETS_S:
        if window_s / b <= points:
            return b
    return _NICE_BUCKETS_S[-1]


def percentiles(values: np.ndarray | pd.Series, qs: tuple[int, ...] = PERCENTILES) -> list[float]:
    """`contracts.latency.percentile` of the non-null values for each q; NaNs when there are none."""
    arr = np.asarray(values, dtype=np.float64)
    kept = arr[~np.isnan(arr)].tolist()
    if not kept:
        return [float("nan")] * len(qs)
    return [float(percentile(kept, q)) for q in qs]


# ---------------------------------------------------------------------------------------------
# Row selection (the only SQL)


def _request_filter(window: Window, time_col=Request.finished_at):
    cond = [time_col >= window.start, time_col < window.end]
    if window.lane is not None:
        cond.append(Request.lane == window.lane)
    if window.model is not None:
        cond.append(Request.model == window.model)
    return and_(*cond)


def _bucket(t: pd.Series, bucket_s: float) -> pd.Series:
    secs = np.floor(t.astype("float64") / bucket_s) * bucket_s
    return pd.to_datetime(secs, unit="s", utc=True)


# The `requests` columns the dashboard reads (not the job line's body/response or wall clocks
# it does not show).
REQUEST_COLUMNS: tuple[str, ...] = (
    "id", "job_id", "lane", "model", "worker_id", "status", "finish_reason", "error",
    "prompt_tokens", "cached_tokens", "completion_tokens", "preemptions", "prefill_chunks",
    "finished_at", "queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "itl_p99_ms",
    "e2e_ms",
)  # fmt: skip
_TEXT_COLUMNS = ("id", "job_id", "lane", "model", "worker_id", "status", "finish_reason", "error")


def _fetch_raw(engine: Engine, stmt) -> list[tuple]:
    """Run `stmt` through the DB-API cursor, skipping SQLAlchemy's per-row result processing
    (2-3x faster on 1e5 rows; the columns read here need no type conversion)."""
    compiled = stmt.compile(dialect=engine.dialect)
    params = compiled.params
    if compiled.positional:
        params = tuple(params[name] for name in compiled.positiontup)
    with engine.connect() as conn:
        return conn.exec_driver_sql(str(compiled), params).fetchall()


def request_rows(engine: Engine, window: Window, limit: int | None = None) -> pd.DataFrame:
    """The finished requests of `window` (by `finished_at`), one row per request.

    Columns: `REQUEST_COLUMNS`; numeric ones float64 (NaN for null: `*_ms`, `finished_at`, token
    counts, preemptions, prefill_chunks), text ones object (None for null). Sorted by
    `finished_at`.
    """
    table = Request.__table__
    stmt = select(*[table.c[c] for c in REQUEST_COLUMNS]).where(_request_filter(window))
    stmt = stmt.order_by(Request.finished_at)
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = _fetch_raw(engine, stmt)
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(REQUEST_COLUMNS)
    data = {}
    for name, values in zip(REQUEST_COLUMNS, columns, strict=True):
        if name in _TEXT_COLUMNS:
            data[name] = np.array(values, dtype=object)
        else:  # column by column: 2x faster than letting pandas infer from the tuples
            data[name] = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    return pd.DataFrame(data)


def worker_rows(engine: Engine, window: Window) -> pd.DataFrame:
    """The `worker_stats` snapshots of `window` (by `at`), sorted by worker and time.

    A lane filter keeps the workers whose comma-joined `lanes` include that lane.
    """
    cond = [WorkerStat.at >= window.start, WorkerStat.at < window.end]
    if window.lane is not None:
        cond.append(or_(WorkerStat.lanes.contains(window.lane), WorkerStat.lanes.is_(None)))
    stmt = (
        select(*[c for c in WorkerStat.__table__.columns if c.name != "id"])
        .where(and_(*cond))
        .order_by(WorkerStat.worker_id, WorkerStat.at)
    )
    with engine.connect() as conn:
        df = pd.read_sql(stmt, conn)
    for c in ("at", "running", "waiting", "kv_usage", "prefix_hit_rate", "step_ms"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ("tokens_per_s", "preemptions"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    df["lanes"] = df["lanes"].fillna("")
    return df


def distinct_values(engine: Engine, column: str) -> list[str]:
    """Distinct non-null values of `requests.<column>` (e.g. "model", "lane"), sorted."""
    if column not in ("model", "lane", "worker_id"):
        raise QueryError(f"no filter on requests.{column}")
    col = Request.__table__.c[column]
    with engine.connect() as conn:
        rows = conn.execute(select(col).where(col.is_not(None)).distinct()).scalars().all()
    return sorted(rows)


def has_data(engine: Engine) -> bool:
    """True when any request, worker snapshot or job has been stored."""
    with engine.connect() as conn:
        for table in (Request, WorkerStat, Job):
            if conn.execute(select(func.count()).select_from(table)).scalar_one():
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Latency


def latency_summary(
    engine: Engine | None, window: Window, rows: pd.DataFrame | None = None
) -> pd.DataFrame:
    """P50/P90/P99 (ms) per lane and phase over the whole window.

    Columns: lane, metric (a `PHASES` label), requests (non-null values), p50, p90, p99 (ms).
    One row per (lane, metric) that has at least one value.
    """
    rows = request_rows(engine, window) if rows is None else rows
    out = []
    for lane, g in rows.groupby("lane", sort=True):
        for label, col in PHASES.items():
            vals = g[col].dropna()
            if len(vals):
                out.append((lane, label, len(vals), *percentiles(vals)))
    return pd.DataFrame(out, columns=["lane", "metric", "requests", "p50", "p90", "p99"])


def latency_over_time(
    engine: Engine | None,
    window: Window,
    bucket_s: float | None = None,
    rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """P50/P90/P99 of every phase per lane and time bucket, in long ("tidy") form for charts.

    Columns: bucket (UTC datetime, bucket start), lane, metric (`PHASES` label), percentile
    ("P50"/"P90"/"P99"), value_ms (float64), requests (values in the bucket).
    """
    rows = request_rows(engine, window) if rows is None else rows
    bucket_s = bucket_s or auto_bucket_s(window.seconds)
    cols = ["bucket", "lane", "metric", "percentile", "value_ms", "requests"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    rows = rows.assign(bucket=_bucket(rows["finished_at"], bucket_s))
    out = []
    for (bucket, lane), g in rows.groupby(["bucket", "lane"], sort=True):
        for label, col in PHASES.items():
            vals = g[col].dropna()
            if not len(vals):
                continue
            for q, v in zip(PERCENTILES, percentiles(vals), strict=True):
                out.append((bucket, lane, label, f"P{q}", v, len(vals)))
    return pd.DataFrame(out, columns=cols)


def latency_histogram(
    engine: Engine | None,
    window: Window,
    metric: str,
    bins: int = 30,
    rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Histogram of one phase (`PHASES` label or column) per lane, on edges shared by all lanes.

    Columns: lane, bin_start_ms, bin_end_ms, count (int). Edges from `np.histogram_bin_edges`
    over all lanes' values; empty frame when there are no values.

    Raises:
        QueryError: unknown metric, or bins < 1.
    """
    col = PHASES.get(metric, metric)
    if col not in PHASES.values():
        raise QueryError(f"unknown metric {metric!r}; expected one of {list(PHASES)}")
    if bins < 1:
        raise QueryError(f"bins must be >= 1, got {bins}")
    rows = request_rows(engine, window) if rows is None else rows
    cols = ["lane", "bin_start_ms", "bin_end_ms", "count"]
    vals = rows[["lane", col]].dropna()
    if vals.empty:
        return pd.DataFrame(columns=cols)
    edges = np.histogram_bin_edges(vals[col].to_numpy(np.float64), bins=bins)
    out = []
    for lane, g in vals.groupby("lane", sort=True):
        counts, _ = np.histogram(g[col].to_numpy(np.float64), bins=edges)
        out += [(lane, edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts)]
    return pd.DataFrame(out, columns=cols)


def throughput(
    engine: Engine | None,
    window: Window,
    bucket_s: float | None = None,
    rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Finished requests and tokens per second, per lane and time bucket.

    Columns: bucket (UTC datetime), lane, requests_per_s, tokens_per_s (completion tokens),
    prompt_tokens_per_s. Rates = sums in the bucket / bucket_s.
    """
    rows = request_rows(engine, window) if rows is None else rows
    bucket_s = bucket_s or auto_bucket_s(window.seconds)
    cols = ["bucket", "lane", "requests_per_s", "tokens_per_s", "prompt_tokens_per_s"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    rows = rows.assign(bucket=_bucket(rows["finished_at"], bucket_s))
    g = rows.groupby(["bucket", "lane"], sort=True)
    df = pd.DataFrame(
        {
            "requests_per_s": g.size() / bucket_s,
            "tokens_per_s": g["completion_tokens"].sum(min_count=0) / bucket_s,
            "prompt_tokens_per_s": g["prompt_tokens"].sum(min_count=0) / bucket_s,
        }
    ).reset_index()
    return df[cols]


def slowest_requests(
    engine: Engine | None,
    window: Window,
    n: int = 20,
    by: str = "e2e",
    rows: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """The `n` slowest requests of the window by a phase (default e2e), with their phase breakdown.

    Columns: id, lane, model, worker_id, status, finished (UTC datetime), prompt_tokens,
    cached_tokens, completion_tokens, preemptions, queue_ms, prefill_ms, ttft_ms, decode_ms,
    tpot_ms, e2e_ms. Sorted slowest first.

    Raises:
        QueryError: unknown phase.
    """
    col = PHASES.get(by, by)
    if col not in PHASES.values():
        raise QueryError(f"unknown metric {by!r}; expected one of {list(PHASES)}")
    rows = request_rows(engine, window) if rows is None else rows
    keep = [
        "id", "lane", "model", "worker_id", "status", "finished", "prompt_tokens", "cached_tokens",
        "completion_tokens", "preemptions", "queue_ms", "prefill_ms", "ttft_ms", "decode_ms",
        "tpot_ms", "e2e_ms",
    ]  # fmt: skip
    top = rows.dropna(subset=[col]).nlargest(n, col)
    top = top.assign(finished=pd.to_datetime(top["finished_at"], unit="s", utc=True))
    return top[keep].reset_index(drop=True)


def phase_breakdown(slowest: pd.DataFrame) -> pd.DataFrame:
    """Long form of `slowest_requests` for a stacked bar: id, phase (queue/prefill/decode), ms.

    queue + prefill + decode is the engine-side part of e2e; the rest is transport.
    """
    parts = slowest[["id", "queue_ms", "prefill_ms", "decode_ms", "e2e_ms"]].copy()
    rest = parts["e2e_ms"] - parts[["queue_ms", "prefill_ms", "decode_ms"]].sum(axis=1)
    parts["other_ms"] = rest.clip(lower=0)
    long = parts.drop(columns="e2e_ms").melt(id_vars="id", var_name="phase", value_name="ms")
    long["phase"] = long["phase"].str.removesuffix("_ms")
    return long.dropna(subset=["ms"])


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

    Columns: id, status, model, task, total, completed, failed, done (0..1, (completed+failed)/total),
    created (UTC datetime), rate_per_s (lines finished per second since in_progress), eta_s (s;
    NaN when finished, not started, or no line finished yet).
    """
    now = time.time() if now is None else now
    cond = Job.status.in_(_ACTIVE_JOB_STATUSES)
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
            Job.created_at,
            Job.in_progress_at,
            Job.request_total,
            Job.request_completed,
            Job.request_failed,
        )  # fmt: skip
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
    active = df["status"].isin(_ACTIVE_JOB_STATUSES)
    df["eta_s"] = (remaining / rate.where(rate > 0)).where(active)
    df["created"] = pd.to_datetime(pd.to_numeric(df["created_at"]), unit="s", utc=True)
    cols = ["id", "status", "model", "task", "total", "completed", "failed", "done", "created"]
    return df[cols + ["rate_per_s", "eta_s"]]


# ---------------------------------------------------------------------------------------------
# Diagnosis figures


def _p(rows: pd.DataFrame, col: str, q: int) -> float | None:
    v = percentiles(rows[col], (q,))[0] if len(rows) else float("nan")
    return None if np.isnan(v) else v


def _is_timeout(rows: pd.DataFrame) -> pd.Series:
    text = (
        rows["error"].fillna("").astype(str) + " " + rows["finish_reason"].fillna("").astype(str)
    ).str.lower()
    return text.str.contains("|".join(_TIMEOUT_MARKERS), regex=True)


def figures_from_frames(
    lane: str,
    recent: pd.DataFrame,
    baseline: pd.DataFrame,
    workers: pd.DataFrame,
    recent_s: float,
    baseline_s: float,
) -> Figures:
    """`Figures` for one lane from its request rows (recent and baseline) and worker snapshots
    of the recent window (as returned by `request_rows` / `worker_rows`)."""
    timeouts = recent[_is_timeout(recent)] if len(recent) else recent
    tok = recent["completion_tokens"].sum() / recent_s if len(recent) else None
    base_tok = baseline["completion_tokens"].sum() / baseline_s if len(baseline) else None
    waiting_now = waiting_before = running_max = kv = hit = None
    if len(workers):
        first = workers.groupby("worker_id").head(1)["waiting"].sum()
        last = workers.groupby("worker_id").tail(1)
        waiting_now, waiting_before = float(last["waiting"].sum()), float(first)
        running_max = float(workers["running"].max())
        kv = float(workers["kv_usage"].max()) if workers["kv_usage"].notna().any() else None
        hit = (
            float(last["prefix_hit_rate"].mean()) if last["prefix_hit_rate"].notna().any() else None
        )
    return Figures(
        lane=lane,
        requests=len(recent),
        ttft_p99_ms=_p(recent, "ttft_ms", 99),
        ttft_p99_baseline_ms=_p(baseline, "ttft_ms", 99),
        tpot_p50_ms=_p(recent, "tpot_ms", 50),
        tpot_p99_ms=_p(recent, "tpot_ms", 99),
        tpot_p99_baseline_ms=_p(baseline, "tpot_ms", 99),
        itl_p99_ms=_p(recent, "itl_p99_ms", 90),
        queue_p99_ms=_p(recent, "queue_ms", 99),
        prefill_p99_ms=_p(recent, "prefill_ms", 99),
        waiting_now=waiting_now,
        waiting_before=waiting_before,
        running_max=running_max,
        kv_usage_max=kv,
        prefix_hit_rate=hit,
        preemptions=int(recent["preemptions"].fillna(0).sum()) if len(recent) else 0,
        timeouts=len(timeouts),
        timeout_prompt_tokens_p50=_p(timeouts, "prompt_tokens", 50),
        prompt_tokens_p50=_p(recent, "prompt_tokens", 50),
        tokens_per_s=tok,
        tokens_per_s_baseline=base_tok,
    )


def live_figures(
    engine: Engine | None,
    window: Window,
    recent_s: float = 300.0,
    rows: pd.DataFrame | None = None,
    ws: pd.DataFrame | None = None,
) -> list[Figures]:
    """`Figures` per lane: the last `recent_s` of `window` against the part of `window` before it.

    `rows`/`ws` are the window's `request_rows`/`worker_rows` when already read. Lanes without
    any request or snapshot in the window are left out.
    """
    recent_s = min(recent_s, window.seconds)
    split = window.end - recent_s
    rows = request_rows(engine, window) if rows is None else rows
    ws = worker_rows(engine, window) if ws is None else ws
    ws = ws[ws["at"] >= split]
    out = []
    for lane in [window.lane] if window.lane else LANES:
        lane_rows = rows[rows["lane"] == lane]
        lane_ws = ws[ws["lanes"].str.contains(lane, regex=False) | (ws["lanes"] == "")]
        if lane_rows.empty and lane_ws.empty:
            continue
        recent = lane_rows[lane_rows["finished_at"] >= split]
        baseline = lane_rows[lane_rows["finished_at"] < split]
        out.append(
            figures_from_frames(
                lane, recent, baseline, lane_ws, recent_s, max(split - window.start, 1e-9)
            )
        )
    return out
