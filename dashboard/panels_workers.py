"""Per-worker and per-SLO panels: what the workers measure, and plainly what they do not yet.

KV usage, prefix hit rate, preemptions and step time come from every worker's snapshots. SLO
targets and attainment, the chosen step budget and predicted step time, and speculative
decoding's acceptance appear when the database has their columns (`dashboard.query_extras`);
until then each says "not measured".
"""

from __future__ import annotations

import streamlit as st

from laneserve.dashboard import charts, queries, query_extras
from laneserve.dashboard.panels import Live


def workers(live: Live) -> None:
    """KV usage, prefix hit rate, preemptions and step time per worker, and the worker table."""
    st.header("Workers")
    if live.ws.empty:
        st.info("No worker snapshots in this window.")
        return
    series = queries.worker_series(None, live.window, live.bucket_s, ws=live.ws)
    a, b, c, d = st.columns(4)
    charts.show(a, charts.worker_lines(series, "kv_usage", "KV usage", live.axis))
    charts.show(b, charts.worker_lines(series, "prefix_hit_rate", "prefix hit rate", live.axis))
    charts.show(c, charts.preemption_bars(series, live.axis))
    charts.show(
        d, charts.worker_lines(series, "step_ms", "mean step time (ms)", live.axis, unit="ms")
    )
    st.dataframe(queries.worker_summary(None, live.window, ws=live.ws), hide_index=True)


def slo(live: Live) -> None:
    """Per-lane SLO targets and attainment, the step budget, predicted vs measured step time."""
    st.header("SLO and step budget")
    found = query_extras.slo_columns(query_extras.table_columns(live.engine, "worker_stats"))
    shown = [c for cols in found.values() for c in cols]
    missing = [label for label, cols in found.items() if not cols]
    if missing:
        st.caption(
            "Not measured yet: " + ", ".join(missing) + " (the workers do not record them; "
            "measured step time is under Workers)."
        )
    if not shown:
        return
    series = query_extras.slo_series(live.engine, live.window, shown, live.bucket_s)
    if series.empty:
        st.caption("No snapshot in this window carries these figures.")
        return
    cols = st.columns(min(3, len(shown)))
    for i, column in enumerate(shown):
        part = series[series["column"] == column]
        unit = None if "attain" in column else ("ms" if column.endswith("_ms") else "tokens")
        chart = charts.worker_lines(
            part.rename(columns={"value": column}), column, column, live.axis, unit=unit
        )
        charts.show(cols[i % len(cols)], chart)


def speculation(live: Live) -> None:
    """Speculative decoding's acceptance rate and mean accepted length per lane over the
    window (the length once the requests record their verifications)."""
    st.header("Speculative decoding")
    columns = query_extras.table_columns(live.engine, "requests")
    if not query_extras.has_spec_columns(columns):
        st.caption("Not measured yet: the requests do not record drafted and accepted tokens.")
        return
    df = query_extras.spec_acceptance(live.engine, live.window, "spec_num_drafts" in columns)
    if df.empty:
        st.caption("No request in this window used speculative decoding.")
        return
    for r, col in zip(df.itertuples(), st.columns(len(df)), strict=True):
        col.metric(
            f"{r.lane} acceptance (accepted / drafted tokens)",
            f"{r.acceptance:.0%}",
            help=f"{int(r.accepted_tokens):,} of {int(r.draft_tokens):,} drafted tokens "
            f"accepted over {int(r.requests):,} requests",
        )
        if r.mean_accepted_length == r.mean_accepted_length:  # not NaN
            col.metric(
                f"{r.lane} mean accepted length (tokens per verification)",
                f"{r.mean_accepted_length:.2f}",
                help=f"1 + {int(r.verified_accepted):,} accepted tokens / "
                f"{int(r.num_drafts):,} verifications that carried drafts",
            )
