"""The dashboard's windows and row readers (the only SQL; see dashboard/queries.py): `Window`,
the requests and worker_stats frames, filters and time buckets, the percentile rule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from sqlalchemy import Engine, and_, or_, select

from laneserve.db.models import Job, Request, WorkerStat

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
    """The q-th percentiles of the non-null values; NaNs when there are none.

    `numpy.percentile`'s default ("linear", Hyndman & Fan definition 7) is the rule of
    `contracts.latency.percentile`, vectorised for large windows (tests check they agree).
    """
    arr = np.asarray(values, dtype=np.float64)
    kept = arr[~np.isnan(arr)]
    if not len(kept):
        return [float("nan")] * len(qs)
    return [float(v) for v in np.percentile(kept, qs)]


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
    return _frame(_fetch_raw(engine, stmt))


def job_request_rows(engine: Engine, job_id: str) -> pd.DataFrame:
    """The lines of job `job_id` that have finished (`finished_at` set), as `request_rows`."""
    table = Request.__table__
    stmt = select(*[table.c[c] for c in REQUEST_COLUMNS]).where(
        Request.job_id == job_id, Request.finished_at.is_not(None)
    )
    return _frame(_fetch_raw(engine, stmt.order_by(Request.finished_at)))


def _frame(rows: list[tuple]) -> pd.DataFrame:
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
    """True when any request, worker snapshot or job has been stored (one row looked at per
    table, not a count: cheap on a large table)."""
    with engine.connect() as conn:
        for table in (Request, WorkerStat, Job):
            pk = table.__table__.primary_key.columns.values()[0]
            if conn.execute(select(pk).limit(1)).first() is not None:
                return True
    return False
