"""laneserve dashboard: live per-phase latency by lane, throughput, workers, jobs, diagnosis.

Run with `laneserve dashboard` (or `streamlit run dashboard/app.py`). The database is
`LANESERVE_DB_URL`, else `$LANESERVE_HOME/laneserve.db` (`db.session.resolve_url`); download
links go to the API at `LANESERVE_URL`. `?job=<id>` opens the view of one job.

The page skeleton (title, sidebar) renders before any query; each panel is its own
`st.fragment(run_every=...)`, so a refresh reruns only the live parts, one short fragment at a
time, and the request rows are read incrementally (`dashboard.live_rows`).
"""

from __future__ import annotations

import streamlit as st

st.set_page_config(page_title="laneserve dashboard", layout="wide")
# A live panel keeps showing its last figures while its fragment reruns: no grey "stale" fade
# every few seconds (the figures are at most one refresh old, and the caption says how often).
st.markdown(
    '<style>[data-stale="true"] {opacity: 1 !important; transition: none !important;}</style>',
    unsafe_allow_html=True,
)
st.title("laneserve")

from sqlalchemy.exc import DBAPIError  # noqa: E402

from laneserve.contracts import env  # noqa: E402
from laneserve.dashboard import live_rows, panels, panels_job, panels_workers, queries  # noqa: E402
from laneserve.db.session import make_engine, resolve_url  # noqa: E402

WINDOWS_S = {"last 15 minutes": 900, "last hour": 3600, "last 6 hours": 21600, "last day": 86400}
ALL = "all"


@st.cache_resource
def get_engine(url: str):
    return make_engine(url)


@st.cache_resource
def row_cache() -> live_rows.RowCache:
    return live_rows.RowCache()


url = resolve_url().render_as_string(hide_password=True)
engine = get_engine(resolve_url().render_as_string(hide_password=False))
api_url = env.get("LANESERVE_URL")

with st.sidebar:
    lane = st.selectbox("lane", [ALL, *queries.LANES], key="lane")
    try:
        models = queries.distinct_values(engine, "model")
    except DBAPIError:
        models = []
    model = st.selectbox("model", [ALL, *models], key="model")
    window_label = st.selectbox("window", list(WINDOWS_S), index=1, key="window")
    refresh_s = st.slider("refresh every (s)", 2, 60, 5, key="refresh_s")
    st.caption(f"Live: each panel refreshes every {refresh_s} s. database: `{url}`")


def live() -> panels.Live:
    """This fragment run's frames: the window up to now, its rows read incrementally."""
    window = queries.Window.last(
        WINDOWS_S[window_label], None if lane == ALL else lane, None if model == ALL else model
    )
    return panels.live_frames(engine, window, row_cache().read(engine, window))


def ready() -> bool:
    """False (with a friendly note) when the database has no tables or nothing stored yet."""
    try:
        stored = queries.has_data(engine)
    except DBAPIError as exc:
        st.info(
            f"The database has no laneserve tables yet (run `laneserve db upgrade`): {exc.orig}"
        )
        return False
    if not stored:
        st.info(
            "No requests recorded yet. Start the stack with `laneserve up` and send a request "
            '(`laneserve chat "hello"`); this page refreshes by itself.'
        )
    return stored


@st.fragment(run_every=refresh_s)
def now_fragment() -> None:
    ok, was = ready(), st.session_state.get("ready")
    st.session_state["ready"] = ok
    if ok and was is False:
        st.rerun()  # the first data arrived: build the other panels
    if not ok:
        return
    data = live()
    panels.diagnosis(data)
    if data.rows.empty:
        st.info(f"No finished request in the {window_label} for this filter.")
    else:
        panels.summary(data, window_label)


@st.fragment(run_every=refresh_s)
def latency_fragment() -> None:
    data = live()
    if not data.rows.empty:
        panels.latency(data)


@st.fragment(run_every=refresh_s)
def load_fragment() -> None:
    data = live()
    panels.throughput(data)
    panels_workers.workers(data)
    panels_workers.slo(data)
    panels_workers.speculation(data)


@st.fragment(run_every=refresh_s)
def jobs_fragment() -> None:
    data = live()
    panels.jobs(data)
    panels.slowest(data)


@st.fragment(run_every=refresh_s)
def job_fragment(job_id: str) -> None:
    panels_job.job_page(engine, job_id, api_url)


job = st.query_params.get("job")
if job:
    job_fragment(job)
else:
    now_fragment()
    if st.session_state.get("ready"):
        latency_fragment()
        load_fragment()
        jobs_fragment()
