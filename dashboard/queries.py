"""The dashboard's SQL: plain functions that take an Engine and a `Window`, return pandas DataFrames.

SQL only selects rows (a time window, a lane, a model); every aggregate — percentiles, histograms,
rates — is computed here in numpy/pandas, so SQLite and PostgreSQL give the same answer.
Percentiles use the one rule of `contracts.latency.percentile` (numpy's default, Hyndman & Fan
definition 7). Time buckets are `floor(t / bucket_s) * bucket_s` over `requests.finished_at` /
`worker_stats.at` (unix seconds; display only — durations come from the `*_ms` columns).

Functions that take `rows=` (a `request_rows` frame) or `ws=` (a `worker_rows` frame) read nothing
when it is given (`engine` may then be None), so one dashboard refresh reads each table once.

This module is the dashboard's one entry point and holds the latency frames; it re-exports the
rest: windows and row readers (`dashboard.query_rows`), worker and job frames
(`dashboard.query_workers`), the diagnosis figures (`dashboard.query_figures`).

No Streamlit here; `dashboard/app.py` only lays these frames out.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from laneserve.dashboard.query_figures import figures_from_frames, live_figures
from laneserve.dashboard.query_rows import (
    LANES,
    PERCENTILES,
    PHASES,
    REQUEST_COLUMNS,
    QueryError,
    Window,
    _bucket,
    auto_bucket_s,
    distinct_values,
    has_data,
    job_request_rows,
    percentiles,
    request_rows,
    worker_rows,
)
from laneserve.dashboard.query_workers import (
    RetentionSummary,
    job_progress,
    lane_load,
    retention_summary,
    worker_series,
    worker_summary,
)

logger = logging.getLogger(__name__)

__all__ = [
    "LANES",
    "PERCENTILES",
    "PHASES",
    "QueryError",
    "REQUEST_COLUMNS",
    "RetentionSummary",
    "Window",
    "CURRENT_S",
    "auto_bucket_s",
    "current_rates",
    "distinct_values",
    "figures_from_frames",
    "has_data",
    "job_request_rows",
    "job_progress",
    "lane_load",
    "latency_histogram",
    "latency_over_time",
    "latency_summary",
    "live_figures",
    "percentiles",
    "phase_breakdown",
    "request_rows",
    "retention_summary",
    "slowest_requests",
    "throughput",
    "worker_rows",
    "worker_series",
    "worker_summary",
]


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
    labels = {col: label for label, col in PHASES.items()}
    long = (
        rows.assign(bucket=_bucket(rows["finished_at"], bucket_s))
        .melt(id_vars=["bucket", "lane"], value_vars=list(labels), var_name="col", value_name="v")
        .dropna(subset=["v"])
    )
    g = long.groupby(["bucket", "lane", "col"], sort=True)["v"]
    # pandas' "linear" quantile is the same rule as `percentiles` (Hyndman & Fan 7)
    q = g.quantile([p / 100 for p in PERCENTILES], interpolation="linear").rename("value_ms")
    out = q.reset_index().rename(columns={"level_3": "q"})
    out = out.merge(g.size().rename("requests").reset_index(), on=["bucket", "lane", "col"])
    out["metric"] = out["col"].map(labels)
    out["percentile"] = "P" + (out["q"] * 100).round().astype(int).astype(str)
    return out[cols]


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


CURRENT_S = 30.0  # s: the span of the "current" rates shown beside the window averages


def current_rates(
    rows: pd.DataFrame, now: float, window: Window, seconds: float = CURRENT_S
) -> pd.DataFrame:
    """Per lane: requests/s and output tokens/s over the last `seconds` before `now` ("now")
    and over the whole window ("window avg"), from a `request_rows` frame.

    Columns: lane, requests (in the window), requests_per_s_now, tokens_per_s_now,
    requests_per_s_avg, tokens_per_s_avg. A request counts when it finishes.
    """
    cols = ["lane", "requests", "requests_per_s_now", "tokens_per_s_now", "requests_per_s_avg",
            "tokens_per_s_avg"]  # fmt: skip
    out = []
    for lane, g in rows.groupby("lane", sort=False):
        last = g[g["finished_at"] >= now - seconds]
        out.append((
            lane, len(g), len(last) / seconds, last["completion_tokens"].sum() / seconds,
            len(g) / window.seconds, g["completion_tokens"].sum() / window.seconds,
        ))  # fmt: skip
    return pd.DataFrame(out, columns=cols)


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
