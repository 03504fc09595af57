"""The per-job view (`?job=<id>`): progress, lines/s and tokens/s over time, ETA against the
completion window, the lines' latency percentiles by phase, the first error lines with their
codes, and the job's files as download links through the API.
"""

from __future__ import annotations

import time

import streamlit as st
from sqlalchemy import Engine

from laneserve.dashboard import charts, queries, query_jobs


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    sign, s = ("-" if seconds < 0 else ""), abs(int(seconds))
    return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def _rate(v: float | None, unit: str) -> str:
    return "-" if v is None else f"{v:,.2f} {unit}"


def job_page(engine: Engine, job_id: str, api_url: str | None) -> None:
    """The whole view of one job; a plain note when there is no such job."""
    view = query_jobs.job_view(engine, job_id)
    st.markdown("[← overview](?)")
    if view is None:
        st.warning(f"No job {job_id!r} in this database.")
        return
    s = view.stats
    st.header(f"Job {s.id}")
    counts = s.request_counts
    done = counts["completed"] + counts["failed"]
    st.progress(
        min(1.0, done / counts["total"]) if counts["total"] else 0.0,
        text=f"{s.status} · {counts['completed']}/{counts['total']} completed, "
        f"{counts['failed']} failed",
    )
    a, b, c, d, e = st.columns(5)
    a.metric("lines/s (over the run)", _rate(s.lines_per_s, "lines/s"))
    b.metric("output tokens/s (over the run)", _rate(s.output_tokens_per_s, "tokens/s"))
    c.metric("elapsed", _dur(s.elapsed_s))
    d.metric("ETA", _dur(s.eta_s) if s.ended_at is None else "done")
    window = view.completion_window or "-"
    e.metric(f"left in completion window ({window})",
             _dur(view.window_left_s) if s.ended_at is None else "ended")  # fmt: skip
    if s.eta_s is not None and view.window_left_s is not None and s.eta_s > view.window_left_s:
        st.warning("At the current rate this job will not finish within its completion window.")
    rows = queries.job_request_rows(engine, job_id)
    if not rows.empty:
        start = float(rows["finished_at"].min()) - 1.0
        end = max(float(rows["finished_at"].max()) + 1.0, s.ended_at or time.time())
        win = queries.Window(start, end)
        bucket = queries.auto_bucket_s(win.seconds)
        axis = charts.TimeAxis(start, end)
        rates = queries.throughput(None, win, bucket, rows=rows)
        left, right = st.columns(2)
        per = f"per {bucket} s bucket"
        lines = charts.rate_lines(rates, "requests_per_s", f"lines/s ({per})", "lines/s", axis)
        charts.show(left, lines)
        tokens = charts.rate_lines(
            rates, "tokens_per_s", f"output tokens/s ({per})", "tokens/s", axis
        )
        charts.show(right, tokens)
        st.subheader("Latency of its lines (ms)")
        table = queries.latency_summary(None, win, rows=rows).drop(columns="lane")
        shown = table.set_index("metric")
        for q in ("p50", "p90", "p99"):
            shown[q] = shown[q].map(lambda v: f"{v:,.1f}")
        st.table(shown)
    st.subheader("First error lines")
    errors = query_jobs.job_errors(engine, job_id)
    if errors.empty:
        st.caption("No error line.")
    else:
        st.table(errors.set_index("line"))
    files(s.files, api_url)


def files(found: dict, api_url: str | None) -> None:
    """Download links of the job's files (`GET /v1/files/{id}/content` on the API)."""
    st.subheader("Files")
    base = (api_url or "").rstrip("/")
    for kind, f in found.items():
        if f is None:
            st.caption(f"{kind}: none")
            continue
        link = f"{base}/v1/files/{f.id}/content"
        st.markdown(f"{kind}: [{f.filename}]({link}) ({f.bytes:,} bytes, `{f.id}`)")
    if not base:
        st.caption("The API address is unknown (start the dashboard with --api-url or set "
                   "LANESERVE_URL): links are relative to this page.")  # fmt: skip
    else:
        st.caption("With an API key, fetch with `curl -H 'Authorization: Bearer $KEY' <link>`.")
