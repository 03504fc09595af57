"""The dashboard's panels: each lays out `queries` frames with `charts` and Streamlit elements.

One function per panel, each taking the engine, the `Window` and the rows already read for this
refresh, so one refresh reads the `requests` and `worker_stats` windows once.
"""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from dashboard import charts, queries
from dashboard.diagnose import diagnose_all


def diagnosis(rows: pd.DataFrame, ws: pd.DataFrame, window: queries.Window) -> None:
    """The symptom table applied to the live figures; one quiet line when healthy."""
    st.header("Diagnosis")
    findings = diagnose_all(queries.live_figures(None, window, rows=rows, ws=ws))
    if not findings:
        st.caption("No symptom of DESIGN.md's table in the last 5 minutes.")
    for f in findings:
        evidence = ", ".join(f"{k} = {v:.4g}" for k, v in f.evidence.items())
        st.warning(
            f"**{f.title}** — {f.advice}\n\nlikely cause: {f.cause}; check: {f.check}\n\n"
            f"_{evidence}_"
        )


def summary(rows: pd.DataFrame, window: queries.Window) -> None:
    """Headline numbers of the window: one row of metrics per lane."""
    table = queries.latency_summary(None, window, rows=rows).set_index(["lane", "metric"])
    for lane, g in rows.groupby("lane", sort=False):
        cols = st.columns(5)
        cols[0].metric(f"{lane} requests", f"{len(g):,}")
        cols[1].metric(
            f"{lane} output tokens/s", f"{g['completion_tokens'].sum() / window.seconds:,.1f}"
        )
        for col, metric, q in zip(
            cols[2:], ("TTFT", "TPOT", "e2e"), ("p99", "p50", "p99"), strict=True
        ):
            value = table[q].get((lane, metric))
            col.metric(f"{metric} {q.upper()} (ms)", "-" if value is None else f"{value:,.1f}")


def latency(rows: pd.DataFrame, window: queries.Window, bucket_s: int) -> None:
    """TTFT, TPOT, queue, prefill, decode, e2e: percentiles over time and histograms."""
    over_time = queries.latency_over_time(None, window, bucket_s, rows=rows)
    for label in queries.PHASES:
        st.header(label)
        left, right = st.columns([3, 2])
        left.altair_chart(charts.latency_lines(over_time, label), width="stretch")
        hist = queries.latency_histogram(None, window, label, rows=rows)
        right.altair_chart(charts.latency_histogram(hist, label), width="stretch")


def throughput(rows: pd.DataFrame, ws: pd.DataFrame, window: queries.Window, bucket_s: int) -> None:
    """Requests and tokens per second per lane; running/waiting per lane group."""
    st.header("Throughput and load")
    rates = queries.throughput(None, window, bucket_s, rows=rows)
    a, b, c = st.columns(3)
    a.altair_chart(charts.rate_lines(rates, "requests_per_s", "requests/s"), width="stretch")
    b.altair_chart(charts.rate_lines(rates, "tokens_per_s", "output tokens/s"), width="stretch")
    load = queries.lane_load(None, window, bucket_s, ws=ws)
    if load.empty:
        c.info("No worker snapshots in this window.")
    else:
        c.altair_chart(charts.lane_load(load), width="stretch")


def workers(ws: pd.DataFrame, window: queries.Window, bucket_s: int) -> None:
    """KV usage, prefix hit rate and preemptions per worker."""
    st.header("Workers")
    if ws.empty:
        st.info("No worker snapshots in this window.")
        return
    series = queries.worker_series(None, window, bucket_s, ws=ws)
    a, b, c = st.columns(3)
    a.altair_chart(charts.worker_lines(series, "kv_usage", "KV usage", True), width="stretch")
    b.altair_chart(
        charts.worker_lines(series, "prefix_hit_rate", "prefix hit rate", True), width="stretch"
    )
    c.altair_chart(charts.preemption_bars(series), width="stretch")
    st.dataframe(queries.worker_summary(None, window, ws=ws), hide_index=True)


def _eta(seconds: float) -> str:
    if seconds is None or math.isnan(seconds):
        return "ETA -"
    return f"ETA {int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m{int(seconds % 60):02d}s"


def jobs(engine: Engine, window: queries.Window) -> None:
    """Progress bars of active and recent bulk jobs."""
    st.header("Jobs")
    df = queries.job_progress(engine, window)
    if df.empty:
        st.caption("No bulk job in this window.")
    for job in df.itertuples():
        text = (
            f"{job.id} · {job.status} · {job.completed}/{job.total} completed, "
            f"{job.failed} failed · {_eta(job.eta_s)}"
        )
        st.progress(float(job.done), text=text)
    st.caption(retention_line(queries.retention_summary(engine)))


def retention_line(r: queries.RetentionSummary) -> str:
    """One line: what the retention passes removed and what is stored."""
    stored = f"stored: {r.stored_files:,} files ({r.stored_bytes / 1e6:,.1f} MB)"
    if r.last_at is None:
        return f"Retention: no pass yet · {stored}"
    last = pd.to_datetime(r.last_at, unit="s", utc=True).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Retention: {r.passes:,} passes, last {last} · pruned {r.files:,} files "
        f"({r.bytes / 1e6:,.1f} MB) and the bodies of {r.lines:,} job lines · {stored}"
    )


def slowest(rows: pd.DataFrame, window: queries.Window) -> None:
    """The slowest requests of the window with their phase breakdown."""
    st.header("Slowest requests")
    top = queries.slowest_requests(None, window, n=15, rows=rows)
    if top.empty:
        st.caption("No finished request in this window.")
        return
    st.altair_chart(charts.phase_breakdown(queries.phase_breakdown(top)), width="stretch")
    st.dataframe(top, hide_index=True)
