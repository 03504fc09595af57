"""laneserve dashboard: live per-phase latency by lane, throughput, workers, jobs, diagnosis.

Run with `laneserve dashboard` (or `streamlit run dashboard/app.py`). The database is
`LANESERVE_DB_URL`, else `$LANESERVE_HOME/laneserve.db` (`db.session.resolve_url`). The SQL lives
in `dashboard.queries`, the charts in `dashboard.charts`, the panels in `dashboard.panels`.
"""

from __future__ import annotations

import streamlit as st
from sqlalchemy.exc import DBAPIError

from dashboard import panels, queries
from db.session import make_engine, resolve_url

WINDOWS_S = {"last 15 minutes": 900, "last hour": 3600, "last 6 hours": 21600, "last day": 86400}
ALL = "all"


@st.cache_resource
def get_engine(url: str):
    return make_engine(url)


st.set_page_config(page_title="laneserve dashboard", layout="wide")
url = resolve_url().render_as_string(hide_password=True)
engine = get_engine(resolve_url().render_as_string(hide_password=False))

with st.sidebar:
    st.title("laneserve")
    lane = st.selectbox("lane", [ALL, *queries.LANES])
    try:
        models = queries.distinct_values(engine, "model")
    except DBAPIError:
        models = []
    model = st.selectbox("model", [ALL, *models])
    window_label = st.selectbox("window", list(WINDOWS_S), index=1)
    refresh_s = st.slider("refresh every (s)", 2, 60, 5)
    st.caption(f"database: `{url}`")


@st.fragment(run_every=refresh_s)
def live() -> None:
    window = queries.Window.last(
        WINDOWS_S[window_label], None if lane == ALL else lane, None if model == ALL else model
    )
    try:
        stored = queries.has_data(engine)
    except DBAPIError as exc:
        st.info(
            f"The database has no laneserve tables yet (run `laneserve db upgrade`): {exc.orig}"
        )
        return
    if not stored:
        st.info(
            "No requests recorded yet. Start the stack with `laneserve up` and send a request "
            '(`laneserve chat "hello"`); this page refreshes by itself.'
        )
        return
    bucket_s = queries.auto_bucket_s(window.seconds)
    rows = queries.request_rows(engine, window)
    ws = queries.worker_rows(engine, window)
    panels.diagnosis(rows, ws, window)
    if rows.empty:
        st.info(f"No finished request in the {window_label} for this filter.")
    else:
        panels.summary(rows, window)
        panels.latency(rows, window, bucket_s)
    panels.throughput(rows, ws, window, bucket_s)
    panels.workers(ws, window, bucket_s)
    panels.jobs(engine, window)
    panels.slowest(rows, window)


live()
