"""Vega-Lite chart specs for the dashboard: DataFrame from `queries` in, `Chart` out.

Pure functions, no Streamlit and no SQL, so the app stays a thin layout. Every chart is a
Vega-Lite spec rendered by the browser (never an image), drawn with `show`
(`st.vega_lite_chart`). The specs are plain dicts rather than Altair objects: building and
validating Altair charts cost ~0.1 s each, which a live page of 20 charts cannot afford.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pandas as pd

LANES = ["interactive", "batch"]
LANE_SCALE = {"domain": LANES, "range": ["#1f77b4", "#ff7f0e"]}
PHASE_SCALE = {
    "domain": ["queue", "prefill", "decode", "other"],
    "range": ["#9467bd", "#d62728", "#2ca02c", "#7f7f7f"],
}
HEIGHT = 260  # px: room for a lane legend and a percentile legend on the right
# Legend symbols drawn as marks: a thick stroke for lines (coloured by the encoding), a grey
# dashed stroke for the percentile/state dash legends (which have no colour of their own).
LINE_LEGEND = {"symbolType": "stroke", "symbolStrokeWidth": 3, "symbolSize": 300}
DASH_LEGEND = {
    "symbolType": "stroke",
    "symbolStrokeWidth": 2,
    "symbolStrokeColor": "#444",
    "symbolSize": 400,
}
BOX_LEGEND = {"symbolType": "square"}


class Chart(NamedTuple):
    """A Vega-Lite `spec` and the `data` it draws (the spec's data source)."""

    data: pd.DataFrame
    spec: dict[str, Any]

    @property
    def title(self) -> str:
        return self.spec.get("title", "")


def show(container, chart: Chart) -> None:
    """Draw `chart` in a Streamlit container (the page, a column), full width."""
    container.vega_lite_chart(chart.data.reset_index(drop=True), chart.spec, width="stretch")


@dataclass(frozen=True, slots=True)
class TimeAxis:
    """The x axis every time chart of one refresh shares: UTC time of the window
    [`start`, `end`) (unix seconds).

    Tick labels follow the tick spacing as Vega's multi-scale time format does (19:40, 19:45,
    ... or :15, :30, ... between whole minutes; the date at midnight), so a label never repeats
    (a fixed `%H:%M` on sub-minute ticks printed "06:50 06:50 06:51"), but on a 24-hour clock:
    Vega's own labels are 12-hour without AM/PM ("07:31" at 19:31 UTC). (A numeric scale
    domain or tick list is not read as dates by the Vega-Lite that Streamlit ships, so the axis
    spans the data.)
    """

    start: float
    end: float

    def x(self, field: str = "bucket") -> dict[str, Any]:
        return {"field": field, "type": "temporal", "title": "time (UTC)",
                "scale": {"type": "utc"},
                "axis": {"labelOverlap": True, "labelExpr": TIME_LABEL_EXPR}}  # fmt: skip


# Vega expression for a UTC time tick's label (datum.value: ms since the epoch).
TIME_LABEL_EXPR = (
    "utcseconds(datum.value) != 0 ? utcFormat(datum.value, ':%S')"
    " : (utchours(datum.value) == 0 && utcminutes(datum.value) == 0)"
    " ? utcFormat(datum.value, '%b %d') : utcFormat(datum.value, '%H:%M')"
)


def _color(field: str, title: str, legend: dict, scale: dict | None = None) -> dict[str, Any]:
    out = {"field": field, "type": "nominal", "title": title, "legend": legend}
    return out | ({"scale": scale} if scale else {})


def _q(field: str, title: str, **kw) -> dict[str, Any]:
    return {"field": field, "type": "quantitative", "title": title, **kw}


def _line(title: str, encoding: dict[str, Any]) -> dict[str, Any]:
    return {"title": title, "height": HEIGHT, "mark": {"type": "line", "point": True},
            "encoding": encoding}  # fmt: skip


def latency_lines(df: pd.DataFrame, metric: str, axis: TimeAxis) -> Chart:
    """P50/P90/P99 over time of one phase: colour = lane, dash = percentile.

    `df` is `queries.latency_over_time`; rows of other metrics are ignored.
    """
    data = df[df["metric"] == metric]
    return Chart(data, _line(f"{metric} P50/P90/P99 (ms)", {
        "x": axis.x(),
        "y": _q("value_ms", "ms"),
        "color": _color("lane", "lane", LINE_LEGEND, LANE_SCALE),
        "strokeDash": {"field": "percentile", "type": "nominal", "title": "percentile",
                       "sort": ["P50", "P90", "P99"], "legend": DASH_LEGEND},
        "tooltip": [{"field": "bucket", "type": "temporal", "format": "%H:%M:%S"},
                    {"field": "lane"}, {"field": "percentile"},
                    {"field": "value_ms", "type": "quantitative", "format": ".1f"},
                    {"field": "requests", "type": "quantitative"}],
    }))  # fmt: skip


def latency_histogram(df: pd.DataFrame, metric: str) -> Chart:
    """Histogram bars of one phase per lane; `df` is `queries.latency_histogram`."""
    return Chart(df, {
        "title": f"{metric} histogram (ms)", "height": HEIGHT,
        "mark": {"type": "bar", "opacity": 0.7, "binSpacing": 0},
        "encoding": {
            "x": _q("bin_start_ms", "ms", bin="binned"),
            "x2": {"field": "bin_end_ms"},
            "y": _q("count", "requests", stack=None),
            "color": _color("lane", "lane", BOX_LEGEND, LANE_SCALE),
            "tooltip": [{"field": f} for f in ("lane", "bin_start_ms", "bin_end_ms", "count")],
        },
    })  # fmt: skip


def rate_lines(df: pd.DataFrame, column: str, title: str, unit: str, axis: TimeAxis) -> Chart:
    """A per-lane rate over time (`unit`: the y axis title); `df` is `queries.throughput`."""
    return Chart(df, _line(title, {
        "x": axis.x(),
        "y": _q(column, unit),
        "color": _color("lane", "lane", LINE_LEGEND, LANE_SCALE),
        "tooltip": [{"field": "bucket", "type": "temporal", "format": "%H:%M:%S"},
                    {"field": "lane"}, {"field": column, "type": "quantitative", "format": ".2f"}],
    }))  # fmt: skip


def lane_load(df: pd.DataFrame, axis: TimeAxis) -> Chart:
    """Running and waiting requests per lane group; `df` is `queries.lane_load`."""
    return Chart(df, _line("running / waiting requests", {
        "x": axis.x(),
        "y": _q("requests", "requests"),
        "color": _color("lanes", "worker lanes", LINE_LEGEND),
        "strokeDash": {"field": "state", "type": "nominal", "title": "state",
                       "legend": DASH_LEGEND},
        "tooltip": [{"field": "bucket", "type": "temporal", "format": "%H:%M:%S"},
                    {"field": "lanes"}, {"field": "state"}, {"field": "requests"}],
    }))  # fmt: skip


def worker_lines(
    df: pd.DataFrame, column: str, title: str, axis: TimeAxis, unit: str | None = None
) -> Chart:
    """One worker gauge over time, a line per worker; `df` is `queries.worker_series`.
    `unit` is the y axis title; None for a fraction in [0, 1], drawn in %."""
    y = _q(column, unit)
    if unit is None:
        y = _q(column, "%", scale={"domain": [0, 1]}, axis={"format": "%"})
    return Chart(df, _line(title, {
        "x": axis.x(),
        "y": y,
        "color": _color("worker_id", "worker", LINE_LEGEND),
        "tooltip": [{"field": "bucket", "type": "temporal", "format": "%H:%M:%S"},
                    {"field": "worker_id"}, {"field": column, "type": "quantitative",
                                             "format": ".3g"}],
    }))  # fmt: skip


def preemption_bars(df: pd.DataFrame, axis: TimeAxis) -> Chart:
    """New preemptions per bucket, stacked by worker; `df` is `queries.worker_series`."""
    return Chart(df, {
        "title": "preemptions", "height": HEIGHT, "mark": "bar",
        "encoding": {
            "x": axis.x(),
            "y": _q("preemptions", "preemptions per bucket",
                    axis={"format": "d", "tickMinStep": 1}),
            "color": _color("worker_id", "worker", BOX_LEGEND),
            "tooltip": [{"field": "bucket", "type": "temporal", "format": "%H:%M:%S"},
                        {"field": "worker_id"}, {"field": "preemptions"}],
        },
    })  # fmt: skip


def phase_breakdown(df: pd.DataFrame) -> Chart:
    """Stacked horizontal bars: queue/prefill/decode/other ms of each slow request;
    `df` is `queries.phase_breakdown`."""
    return Chart(df, {
        "title": "slowest requests: where the time went (ms)", "mark": "bar",
        "transform": [{"calculate": "indexof(['queue', 'prefill', 'decode', 'other'], "
                                    "datum.phase)", "as": "phase_order"}],
        "encoding": {
            "y": {"field": "id", "type": "nominal", "sort": None, "title": None},
            "x": _q("ms", "ms", stack="zero"),
            "color": _color("phase", "phase", BOX_LEGEND, PHASE_SCALE),
            "order": {"field": "phase_order", "type": "quantitative"},
            "tooltip": [{"field": "id"}, {"field": "phase"},
                        {"field": "ms", "type": "quantitative", "format": ".1f"}],
        },
    })  # fmt: skip
