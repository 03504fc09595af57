"""The Streamlit app under `streamlit.testing.v1.AppTest`: empty and filled databases."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
from dashboard_data import Profile, make_records, make_snapshots, store
from streamlit.testing.v1 import AppTest

from dashboard.queries import PHASES


def _charts(at: AppTest) -> dict[str, int]:
    """Vega-Lite charts on the page: title -> number of data rows sent with it."""
    out = {}
    for el in at.get("vega_lite_chart"):
        title = json.loads(el.proto.spec).get("title")
        title = title if isinstance(title, str) else (title or {}).get("text", "")
        blobs = [d.data.data for d in el.proto.datasets]
        blobs += [el.proto.data.data] if el.proto.HasField("data") and el.proto.data.data else []
        rows = sum(pa.ipc.open_stream(b).read_all().num_rows for b in blobs)
        out[title] = rows
    return out


def test_empty_database_shows_friendly_state(db_url, run_app):
    at = run_app(db_url)
    assert any("No requests recorded yet" in i.value for i in at.info)
    assert _charts(at) == {}


def test_unmigrated_database_is_explained(tmp_path, run_app):
    at = run_app(f"sqlite:///{tmp_path / 'nothing.db'}")
    assert any("no laneserve tables" in i.value for i in at.info)


def test_filled_database_shows_latency_charts(db_url, db_engine, run_app):
    now = time.time()
    rng = np.random.default_rng(3)
    recs = make_records(rng, 150, now - 3000, now - 1, "interactive", model="m1")
    recs += make_records(rng, 80, now - 3000, now - 1, "batch", Profile(prefill=300), model="m1")
    snaps = make_snapshots("w0", "interactive,batch", now - 600, now, every_s=10, kv_usage=0.4)
    jobs = [
        {"id": "batch_x", "status": "in_progress", "endpoint": "/v1/chat/completions",
         "model": "m1", "created_at": now - 100, "in_progress_at": now - 90,
         "request_total": 100, "request_completed": 40, "request_failed": 5},
    ]  # fmt: skip
    store(db_engine, records=recs, snapshots=snaps, jobs=jobs)

    at = run_app(db_url)
    headers = [h.value for h in at.header]
    for label in PHASES:
        assert label in headers
    charts = _charts(at)
    for label in PHASES:
        assert charts[f"{label} P50/P90/P99 (ms)"] > 0  # percentile points were sent
        assert charts[f"{label} histogram (ms)"] > 0
    for title in ("requests/s (per 60 s bucket)", "output tokens/s (per 60 s bucket)",
                  "KV usage", "prefix hit rate", "preemptions", "mean step time (ms)"):  # fmt: skip
        assert charts[title] > 0
    assert "Diagnosis" in headers
    assert not at.warning  # healthy traffic: the diagnosis stays quiet
    assert any("No symptom in the last 5 minutes" in s.value for s in at.success)
    # current rates beside the window's averages, each labelled with its span
    labels = [m.label for m in at.metric]
    assert {"interactive · requests", "batch · requests"} <= set(labels)
    assert {"tokens/s · last 30 s", "tokens/s · window avg"} <= set(labels)
    # what is not measured yet is said plainly
    captions = " ".join(c.value for c in at.caption)
    assert "Not measured yet: SLO attainment" in captions
    assert "do not record drafted and accepted tokens" in captions
    assert "DESIGN" not in captions + " ".join(m.value for m in at.markdown)
    progress = [p.proto.text for p in at.get("progress")]
    assert any("batch_x" in t and "40/100 completed" in t and "5 failed" in t for t in progress)
    assert any("Slowest requests" == h for h in headers)


def test_lane_filter_rerenders(db_url, db_engine, run_app):
    now = time.time()
    rng = np.random.default_rng(4)
    store(db_engine, records=make_records(rng, 50, now - 600, now - 1, "interactive"))
    at = run_app(db_url)
    at.sidebar.selectbox[0].select("batch").run()
    assert not at.exception
    # no batch request: the latency panels give way to a note, nothing crashes
    assert any("No finished request" in i.value for i in at.info)
