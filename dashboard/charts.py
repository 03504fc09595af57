"""Altair (Vega-Lite) chart builders for the dashboard: DataFrame from `queries` in, chart out.

Pure functions, no Streamlit and no SQL, so the app stays a thin layout. Every chart is a
Vega-Lite spec rendered by the browser (never an image).
"""

from __future__ import annotations

from dataclasses import dataclass

import altair as alt
import pandas as pd

LANE_COLORS = alt.Scale(domain=["interactive", "batch"], range=["#1f77b4", "#ff7f0e"])
PHASE_COLORS = alt.Scale(
    domain=["queue", "prefill", "decode", "other"],
    range=["#9467bd", "#d62728", "#2ca02c", "#7f7f7f"],
)
HEIGHT = 260  # px: room for a lane legend and a percentile legend on the right
# Legend symbols drawn as marks: a thick stroke for lines (coloured by the encoding), a grey
# dashed stroke for the percentile/state dash legends (which have no colour of their own).
COLOR_LEGEND = alt.Legend(symbolType="stroke", symbolStrokeWidth=3, symbolSize=300)
DASH_LEGEND = alt.Legend(
    symbolType="stroke", symbolStrokeWidth=2, symbolStrokeColor="#444", symbolSize=400
)
# Tick spacing per window length: one label per tick, never the same label twice.
_TICKS = ((900, "minute", 2), (3600, "minute", 10), (21600, "hour", 1), (float("inf"), "hour", 3))


@dataclass(frozen=True, slots=True)
class TimeAxis:
    """The x axis every time chart of one refresh shares: the window (unix seconds) as the
    domain, ticks at whole minutes/hours spaced by the window's length, labels `%H:%M`."""

    start: float
    end: float

    def x(self, field: str = "bucket") -> alt.X:
        span = self.end - self.start
        unit, step = next((u, s) for limit, u, s in _TICKS if span <= limit)
        domain = [pd.Timestamp(self.start, unit="s", tz="UTC").isoformat(),
                  pd.Timestamp(self.end, unit="s", tz="UTC").isoformat()]  # fmt: skip
        return alt.X(
            f"{field}:T",
            title="time (UTC)",
            scale=alt.Scale(domain=domain, type="utc"),
            axis=alt.Axis(
                format="%H:%M", tickCount=alt.TimeIntervalStep(interval=unit, step=step),
                labelOverlap=True,
            ),
        )  # fmt: skip


def latency_lines(df: pd.DataFrame, metric: str, axis: TimeAxis) -> alt.Chart:
    """P50/P90/P99 over time of one phase: colour = lane, dash = percentile.

    `df` is `queries.latency_over_time`; rows of other metrics are ignored.
    """
    data = df[df["metric"] == metric]
    return (
        alt.Chart(data, height=HEIGHT, title=f"{metric} P50/P90/P99 (ms)")
        .mark_line(point=True)
        .encode(
            x=axis.x(),
            y=alt.Y("value_ms:Q", title="ms"),
            color=alt.Color("lane:N", scale=LANE_COLORS, legend=COLOR_LEGEND),
            strokeDash=alt.StrokeDash(
                "percentile:N", sort=["P50", "P90", "P99"], legend=DASH_LEGEND
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
        alt.Chart(df, height=HEIGHT, title=f"{metric} histogram (ms)")
        .mark_bar(opacity=0.7, binSpacing=0)
        .encode(
            x=alt.X("bin_start_ms:Q", title="ms", bin="binned"),
            x2="bin_end_ms:Q",
            y=alt.Y("count:Q", title="requests", stack=None),
            color=alt.Color("lane:N", scale=LANE_COLORS, legend=alt.Legend(symbolType="square")),
            tooltip=["lane:N", "bin_start_ms:Q", "bin_end_ms:Q", "count:Q"],
        )
    )


def rate_lines(df: pd.DataFrame, column: str, title: str, unit: str, axis: TimeAxis) -> alt.Chart:
    """A per-lane rate over time (`unit`: the y axis title); `df` is `queries.throughput`."""
    return (
        alt.Chart(df, height=HEIGHT, title=title)
        .mark_line(point=True)
        .encode(
            x=axis.x(),
            y=alt.Y(f"{column}:Q", title=unit),
            color=alt.Color("lane:N", scale=LANE_COLORS, legend=COLOR_LEGEND),
            tooltip=["bucket:T", "lane:N", alt.Tooltip(f"{column}:Q", format=".2f")],
        )
    )


def lane_load(df: pd.DataFrame, axis: TimeAxis) -> alt.Chart:
    """Running and waiting requests per lane group; `df` is `queries.lane_load`."""
    return (
        alt.Chart(df, height=HEIGHT, title="running / waiting requests")
        .mark_line(point=True)
        .encode(
            x=axis.x(),
            y=alt.Y("requests:Q", title="requests"),
            color=alt.Color("lanes:N", title="worker lanes", legend=COLOR_LEGEND),
            strokeDash=alt.StrokeDash("state:N", legend=DASH_LEGEND),
            tooltip=["bucket:T", "lanes:N", "state:N", "requests:Q"],
        )
    )


def worker_lines(
    df: pd.DataFrame, column: str, title: str, axis: TimeAxis, unit: str | None = None
) -> alt.Chart:
    """One worker gauge over time, a line per worker; `df` is `queries.worker_series`.
    `unit` is the y axis title; None for a fraction in [0, 1], drawn in %."""
    y = alt.Y(f"{column}:Q", title=unit)
    if unit is None:
        y = alt.Y(
            f"{column}:Q", title="%", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")
        )
    return (
        alt.Chart(df, height=HEIGHT, title=title)
        .mark_line(point=True)
        .encode(
            x=axis.x(),
            y=y,
            color=alt.Color("worker_id:N", title="worker", legend=COLOR_LEGEND),
            tooltip=["bucket:T", "worker_id:N", alt.Tooltip(f"{column}:Q", format=".3g")],
        )
    )


def preemption_bars(df: pd.DataFrame, axis: TimeAxis) -> alt.Chart:
    """New preemptions per bucket, stacked by worker; `df` is `queries.worker_series`."""
    return (
        alt.Chart(df, height=HEIGHT, title="preemptions")
        .mark_bar()
        .encode(
            x=axis.x(),
            y=alt.Y(
                "preemptions:Q",
                title="preemptions per bucket",
                axis=alt.Axis(format="d", tickMinStep=1),
            ),
            color=alt.Color("worker_id:N", title="worker", legend=alt.Legend(symbolType="square")),
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
            color=alt.Color("phase:N", scale=PHASE_COLORS, legend=alt.Legend(symbolType="square")),
            order=alt.Order("phase_order:Q"),
            tooltip=["id:N", "phase:N", alt.Tooltip("ms:Q", format=".1f")],
        )
        .transform_calculate(
            phase_order="indexof(['queue', 'prefill', 'decode', 'other'], datum.phase)"
        )
    )
