"""The Streamlit app under `streamlit.testing.v1.AppTest`: empty and filled databases."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pyarrow as pa
from dashboard_data import Profile, make_records, make_snapshots, store
from streamlit.testing.v1 import AppTest

from laneserve.dashboard.queries import PHASES
from laneserve.db.models import File
from laneserve.db.session import write_session


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
         "model": "m1", "task": "summarize", "input_file_id": "file_docs",
         "created_at": now - 100, "in_progress_at": now - 90,
         "request_total": 100, "request_completed": 40, "request_failed": 5},
        {"id": "batch_bad", "status": "failed", "endpoint": "/v1/chat/completions",
         "model": "m1", "created_at": now - 50, "failed_at": now - 49,
         "errors": [{"code": "invalid_json", "message": "not JSON", "line": 2}]},
    ]  # fmt: skip
    with write_session(db_engine) as s:
        s.add(File(id="file_docs", purpose="batch", filename="docs.jsonl", bytes=10, path="-",
                   created_at=now - 101))  # fmt: skip
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
    assert {"requests", "tok/s · last 30 s", "tok/s · window avg", "TTFT P99"} <= set(labels)
    assert {"**interactive**", "**batch**"} <= {m.value for m in at.markdown}
    ttft = [m.value for m in at.metric if m.label == "TTFT P99"]
    assert len(ttft) == 2 and all(re.fullmatch(r"[\d.]+k? (ms|s|min)", v) for v in ttft), ttft
    # figures these workers did not record are said plainly, not drawn as zeros
    captions = " ".join(c.value for c in at.caption)
    assert "No snapshot in this window carries these figures" in captions  # SLO columns empty
    assert "No request in this window used speculative decoding" in captions
    assert "DESIGN" not in captions + " ".join(m.value for m in at.markdown)
    progress = [p.proto.text for p in at.get("progress")]
    assert any("batch_x · summarize · docs.jsonl" in t and "40/100 completed" in t
               and "5 failed" in t for t in progress)  # fmt: skip
    # a job refused by validation says why, not "failed · 0/0"
    refused = [e.value for e in at.error if "batch_bad" in e.value]
    assert refused and "line 2: invalid_json: not JSON" in refused[0], refused
    assert not any("batch_bad" in t for t in progress)
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


def test_job_view_shows_progress_latency_and_error_lines(db_url, db_engine, run_app, monkeypatch):
    now = time.time()
    rng = np.random.default_rng(6)
    job = {"id": "batch_j", "status": "completed", "endpoint": "/v1/chat/completions",
           "model": "m1", "created_at": now - 400, "in_progress_at": now - 390,
           "completed_at": now - 10, "expires_at": now + 86000, "request_total": 12,
           "request_completed": 10, "request_failed": 2}  # fmt: skip
    lines = make_records(rng, 10, now - 380, now - 20, "batch")
    for i, r in enumerate(lines):
        r.update(job_id="batch_j", custom_id=f"doc-{i}", line_no=i + 1)
    store(db_engine, records=lines, jobs=[job])
    import sqlalchemy as sa

    from laneserve.db.models import Request

    with db_engine.begin() as conn:
        conn.execute(sa.update(Request).where(Request.job_id == "batch_j")
                     .values(response={"status_code": 200}, status="completed"))  # fmt: skip
        for n in (11, 12):
            conn.execute(sa.insert(Request).values(
                id=f"r{n}", job_id="batch_j", custom_id=f"doc-{n}", line_no=n, lane="batch",
                status="failed", response={"error": {"code": "prompt_too_long", "message": "x"}},
            ))  # fmt: skip
    monkeypatch.setenv("LANESERVE_URL", "http://127.0.0.1:8000")
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.conftest import APP

    monkeypatch.setenv("LANESERVE_DB_URL", db_url)
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["job"] = "batch_j"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Job batch_j" in [h.value for h in at.header]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["lines/s (over the run)"] == f"{12 / 380:,.2f} lines/s"
    tokens = sum(r["completion_tokens"] for r in lines)
    assert metrics["output tokens/s (over the run)"] == f"{tokens / 380:,.2f} tokens/s"
    assert metrics["ETA"] == "done"
    (latency, errors) = [t.value for t in at.table]
    ttft = np.percentile([r["ttft_ms"] for r in lines], 50)
    assert latency.loc["TTFT", "p50"] == f"{ttft:,.1f}"
    assert errors["code"].tolist() == ["prompt_too_long", "prompt_too_long"]
    assert errors.index.tolist() == [11, 12]
    charts = _charts(at)
    assert charts["lines/s (per 10 s bucket)"] > 0


def test_slo_columns_of_an_older_schema_are_reported_not_measured():
    from laneserve.dashboard.query_extras import has_spec_columns, slo_columns

    old = ["at", "worker_id", "kv_usage", "step_ms", "running"]
    assert all(cols == [] for cols in slo_columns(old).values())
    new = old + ["slo_batch_attainment", "slo_interactive_tpot_ms", "step_token_budget"]
    found = slo_columns(new)
    assert found["SLO attainment"] == ["slo_batch_attainment"]
    assert found["SLO target"] == ["slo_interactive_tpot_ms"]
    assert found["step budget"] == ["step_token_budget"]
    assert found["predicted step time"] == []
    assert not has_spec_columns(old) and has_spec_columns(
        ["spec_draft_tokens", "spec_accepted_tokens"]
    )


def test_slo_and_speculation_panels_show_columns_once_they_exist(db_url, db_engine, run_app):
    """The SLO controller's worker_stats columns and the speculation counts, once recorded."""
    import sqlalchemy as sa

    now = time.time()
    rng = np.random.default_rng(2)
    store(db_engine, records=make_records(rng, 30, now - 600, now - 1, "interactive"),
          snapshots=make_snapshots("w0", "interactive", now - 600, now, every_s=30))  # fmt: skip
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE worker_stats SET slo_interactive_attainment = 0.97, "
                "step_token_budget = 512, predicted_step_ms = 21.5, measured_step_ms = 23.0"
            )
        )
        conn.execute(
            sa.text(
                "UPDATE requests SET spec_draft_tokens = 10, spec_accepted_tokens = 7, "
                "spec_num_drafts = 4"
            )
        )
        conn.execute(  # rows recorded before migration 0007: no verifications
            sa.text("UPDATE requests SET spec_num_drafts = NULL WHERE completion_tokens % 2 = 0")
        )
    at = run_app(db_url)
    charts = _charts(at)
    assert charts["slo_interactive_attainment"] > 0 and charts["step_token_budget"] > 0
    assert charts["predicted_step_ms"] > 0 and charts["measured_step_ms"] > 0
    captions = " ".join(c.value for c in at.caption)
    assert "Not measured yet" not in captions
    (acc,) = [m for m in at.metric if "acceptance" in m.label]
    assert acc.value == "70%"
    (length,) = [m for m in at.metric if "mean accepted length" in m.label]
    # 1 + 7 accepted / 4 verifications per request that records them (the others' accepted
    # tokens are not divided by verifications they never counted)
    assert length.value == "2.75"


def test_headline_figures_are_compact_with_units():
    from laneserve.dashboard.panels import compact, duration_ms

    assert [compact(v) for v in (7, 12.34, 110_981.2, 2_500_000)] == ["7", "12.3", "111k", "2.5M"]
    assert [duration_ms(v) for v in (85.34, 1_234, 110_981.2, 3e6)] == [
        "85.3 ms", "1.2 s", "111 s", "50 min",
    ]  # fmt: skip
    assert compact(float("nan"), "tok/s") == duration_ms(None) == "-"
