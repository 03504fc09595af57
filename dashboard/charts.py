"""Altair (Vega-Lite) chart builders for the dashboard: DataFrame from `queries` in, chart out.

Pure functions, no Streamlit and no SQL, so the app stays a thin layout. Every chart is a
Vega-Lite spec rendered by the browser (never an image).
"""

from __future__ import annotations

import altair as alt
import pandas as pd

LANE_COLORS = alt.Scale(domain=["interactive", "batch"], range=["#1f77b4", "#ff7f0e"])
PHASE_COLORS = alt.Scale(
    domain=["queue", "prefill", "decode", "other"],
    range=["#9467bd", "#d62728", "#2ca02c", "#7f7f7f"],
)
HEIGHT = 260  # px: room for a lane legend and a percentile legend on the right


def _time_x() -> alt.X:
    return alt.X("bucket:T", title=None, axis=alt.Axis(format="%H:%M"))


def latency_lines(df: pd.DataFrame, metric: str) -> alt.Chart:
    """P50/P90/P99 over time of one phase: colour = lane, dash = percentile.

    `df` is `queries.latency_over_time`; rows of other metrics are ignored.
    """
    data = df[df["metric"] == metric]
    return (
        alt.Chart(data, height=HEIGHT, title=f"{metric} P50/P90/P99 (ms)")
        .mark_line(point=True)
        .encode(
            x=_time_x(),
            y=alt.Y("value_ms:Q", title="ms"),
            color=alt.Color("lane:N", scale=LANE_COLORS),
            strokeDash=alt.StrokeDash(
                "percentile:N", sort=["P50", "P90", "P99"], legend=alt.Legend(symbolType="stroke")
            ),
            tooltip=[
                "bucket:T",
                "lane:N",
                "percentile:N",
                alt.Tooltip("value_ms:Q", format=".1f"),
                "requests:Q",
            ],  # fmt: skip
        )
    )


def latency_histogram(df: pd.DataFrame, metric: str) -> alt.Chart:
    """Histogram bars of one phase per lane; `df` is `queries.latency_histogram`."""
    return (
        alt.Chart(df, height=HEIGHT, title=f"{metric} histogram")
        .mark_bar(opacity=0.7, binSpacing=0)
        .encode(
            x=alt.X("bin_start_ms:Q", title="ms", bin="binned"),
            x2="bin_end_ms:Q",
            y=alt.Y("count:Q", title="requests", stack=None),
            color=alt.Color("lane:N", scale=LANE_COLORS),
            tooltip=["lane:N", "bin_start_ms:Q", "bin_end_ms:Q", "count:Q"],
        )
    )


def rate_lines(df: pd.DataFrame, column: str, title: str) -> alt.Chart:
    """A per-lane rate over time; `df` is `queries.throughput`."""
    return (
        alt.Chart(df, height=HEIGHT, title=title)
        .mark_line(point=True)
        .encode(
            x=_time_x(),
            y=alt.Y(f"{column}:Q", title="per second"),
            color=alt.Color("lane:N", scale=LANE_COLORS),
            tooltip=["bucket:T", "lane:N", alt.Tooltip(f"{column}:Q", format=".2f")],
        )
    )


def lane_load(df: pd.DataFrame) -> alt.Chart:
    """Running and waiting requests per lane group; `df` is `queries.lane_load`."""
    return (
        alt.Chart(df, height=HEIGHT, title="running / waiting requests")
        .mark_line(point=True)
        .encode(
            x=_time_x(),
            y=alt.Y("requests:Q", title="requests"),
            color=alt.Color("lanes:N", title="worker lanes"),
            strokeDash=alt.StrokeDash("state:N", legend=alt.Legend(symbolType="stroke")),
            tooltip=["bucket:T", "lanes:N", "state:N", "requests:Q"],
        )
    )


def worker_lines(df: pd.DataFrame, column: str, title: str, fraction: bool = False) -> alt.Chart:
    """One worker gauge over time, a line per worker; `df` is `queries.worker_series`."""
    y = alt.Y(f"{column}:Q", title=None)
    if fraction:
        y = alt.Y(
            f"{column}:Q", title=None, scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")
        )
    return (
        alt.Chart(df, height=HEIGHT, title=title)
        .mark_line(point=True)
        .encode(
            x=_time_x(),
            y=y,
            color=alt.Color("worker_id:N", title="worker"),
            tooltip=["bucket:T", "worker_id:N", alt.Tooltip(f"{column}:Q", format=".3g")],
        )
    )


def preemption_bars(df: pd.DataFrame) -> alt.Chart:
    """New preemptions per bucket, stacked by worker; `df` is `queries.worker_series`."""
    return (
        alt.Chart(df, height=HEIGHT, title="preemptions")
        .mark_bar()
        .encode(
            x=_time_x(),
            y=alt.Y("preemptions:Q", title="preemptions", axis=alt.Axis(format="d", tickMinStep=1)),
            color=alt.Color("worker_id:N", title="worker"),
            tooltip=["bucket:T", "worker_id:N", "preemptions:Q"],
        )
    )


def phase_breakdown(df: pd.DataFrame) -> alt.Chart:
    """Stacked horizontal bars: queue/prefill/decode/other ms of each slow request;
    `df` is `queries.phase_breakdown`."""
    return (
        alt.Chart(df, title="slowest requests: where the time went (ms)")
        .mark_bar()
        .encode(
            y=alt.Y("id:N", sort=None, title=None),
            x=alt.X("ms:Q", title="ms", stack="zero"),
            color=alt.Color("phase:N", scale=PHASE_COLORS),
            order=alt.Order("phase_order:Q"),
            tooltip=["id:N", "phase:N", alt.Tooltip("ms:Q", format=".1f")],
        )
        .transform_calculate(
            phase_order="indexof(['queue', 'prefill', 'decode', 'other'], datum.phase)"
        )
    )
