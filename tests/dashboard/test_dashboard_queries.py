"""queries.py on SQLite and PostgreSQL: percentiles, histograms, rates equal numpy's on the rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from dashboard_data import MODEL, NOW, Profile, make_records, make_snapshots, store

from laneserve.contracts.latency import percentile
from laneserve.dashboard.diagnose import Cause, Symptom, diagnose_all
from laneserve.dashboard.queries import (
    PHASES,
    QueryError,
    Window,
    auto_bucket_s,
    current_rates,
    distinct_values,
    has_data,
    job_progress,
    lane_load,
    latency_histogram,
    latency_over_time,
    latency_summary,
    live_figures,
    percentiles,
    phase_breakdown,
    slowest_requests,
    throughput,
    worker_series,
    worker_summary,
)

HOUR = 3600.0


@pytest.fixture
def traffic(db_engine):
    """An hour of both lanes, plus rows outside the window and of another model."""
    rng = np.random.default_rng(7)
    recs = make_records(rng, 300, NOW - HOUR, NOW, "interactive")
    recs += make_records(rng, 200, NOW - HOUR, NOW, "batch", Profile(prefill=400, tpot=35))
    recs += make_records(rng, 40, NOW - 3 * HOUR, NOW - HOUR, "interactive")  # too old
    recs += make_records(rng, 30, NOW - HOUR, NOW, "interactive", model="other-model")
    recs[0]["tpot_ms"] = None  # nulls are skipped, not zero
    store(db_engine, records=recs)
    return recs


def _expected(recs, col, lane, start=NOW - HOUR, end=NOW, model=MODEL):
    vals = [
        r[col]
        for r in recs
        if r["lane"] == lane and start <= r["finished_at"] < end and r["model"] == model
        and r[col] is not None
    ]  # fmt: skip
    return np.asarray(vals, dtype=np.float64)


def test_summary_percentiles_equal_numpy(db_engine, traffic):
    df = latency_summary(db_engine, Window(NOW - HOUR, NOW, model=MODEL))
    assert set(df["lane"]) == {"interactive", "batch"}
    assert sorted(df["metric"].unique()) == sorted(PHASES)
    for row in df.itertuples():
        vals = _expected(traffic, PHASES[row.metric], row.lane)
        assert row.requests == len(vals)
        np.testing.assert_allclose(
            [row.p50, row.p90, row.p99], np.percentile(vals, [50, 90, 99]), rtol=1e-12
        )
    # the null TPOT is excluded
    tpot = df[(df.lane == "interactive") & (df.metric == "TPOT")].iloc[0]
    ttft = df[(df.lane == "interactive") & (df.metric == "TTFT")].iloc[0]
    assert tpot.requests == len(_expected(traffic, "tpot_ms", "interactive")) < ttft.requests


def test_over_time_percentiles_equal_numpy_per_bucket(db_engine, traffic):
    df = latency_over_time(db_engine, Window(NOW - HOUR, NOW, model=MODEL), bucket_s=600)
    assert set(df["percentile"]) == {"P50", "P90", "P99"}
    assert df["bucket"].nunique() == 6
    checked = 0
    for (bucket, lane, metric), g in df.groupby(["bucket", "lane", "metric"]):
        start = bucket.timestamp()
        vals = _expected(traffic, PHASES[metric], lane, start, start + 600)
        got = g.set_index("percentile")["value_ms"]
        np.testing.assert_allclose(
            [got["P50"], got["P90"], got["P99"]], np.percentile(vals, [50, 90, 99]), rtol=1e-12
        )
        checked += 1
    assert checked == 6 * 2 * len(PHASES)


def test_lane_and_model_filters(db_engine, traffic):
    batch = latency_summary(db_engine, Window(NOW - HOUR, NOW, lane="batch"))
    assert set(batch["lane"]) == {"batch"}
    every_model = latency_summary(db_engine, Window(NOW - HOUR, NOW, lane="interactive"))
    e2e = every_model[every_model.metric == "e2e"].iloc[0]
    assert e2e.requests == 300 + 30
    assert distinct_values(db_engine, "model") == sorted([MODEL, "other-model"])
    assert distinct_values(db_engine, "lane") == ["batch", "interactive"]


def test_histogram_matches_numpy(db_engine, traffic):
    df = latency_histogram(db_engine, Window(NOW - HOUR, NOW, model=MODEL), "TTFT", bins=20)
    all_vals = np.concatenate(
        [_expected(traffic, "ttft_ms", ln) for ln in ("batch", "interactive")]
    )
    edges = np.histogram_bin_edges(all_vals, bins=20)
    for lane, g in df.groupby("lane"):
        counts, _ = np.histogram(_expected(traffic, "ttft_ms", lane), bins=edges)
        assert g["count"].tolist() == counts.tolist()
        np.testing.assert_allclose(g["bin_start_ms"], edges[:-1])
    with pytest.raises(QueryError, match="unknown metric"):
        latency_histogram(db_engine, Window(NOW - HOUR, NOW), "latency")


def test_throughput_rates(db_engine, traffic):
    df = throughput(db_engine, Window(NOW - HOUR, NOW, model=MODEL), bucket_s=900)
    for row in df.itertuples():
        start = row.bucket.timestamp()
        rs = [
            r for r in traffic
            if r["lane"] == row.lane and start <= r["finished_at"] < start + 900
            and r["model"] == MODEL
        ]  # fmt: skip
        assert row.requests_per_s == pytest.approx(len(rs) / 900)
        assert row.tokens_per_s == pytest.approx(sum(r["completion_tokens"] for r in rs) / 900)
    totals = df.groupby("lane")["requests_per_s"].sum().mul(900).round(9).to_dict()
    assert totals == {"batch": 200, "interactive": 300}


def test_slowest_requests_with_breakdown(db_engine, traffic):
    df = slowest_requests(db_engine, Window(NOW - HOUR, NOW, model=MODEL), n=5)
    inwin = [r for r in traffic if NOW - HOUR <= r["finished_at"] < NOW and r["model"] == MODEL]
    expected = sorted(inwin, key=lambda r: -r["e2e_ms"])[:5]
    assert df["id"].tolist() == [r["id"] for r in expected]
    parts = phase_breakdown(df)
    assert set(parts["phase"]) == {"queue", "prefill", "decode", "other"}
    sums = parts.groupby("id")["ms"].sum()
    for r in expected:
        assert sums[r["id"]] == pytest.approx(r["e2e_ms"])


def test_workers_preemptions_and_load(db_engine):
    snaps = make_snapshots("w0", "interactive", NOW - 600, NOW, every_s=60, kv_usage=0.8,
                           waiting=2, preemptions=[0, 1, 3, 3, 5, 0, 1, 1, 2, 2])  # fmt: skip
    snaps += make_snapshots("w1", "batch", NOW - 600, NOW, every_s=60, running=30, kv_usage=0.3)
    store(db_engine, snapshots=snaps)
    win = Window(NOW - 600, NOW)
    summary = worker_summary(db_engine, win).set_index("worker_id")
    # increases 1,2,0,2 then a restart (5 -> 0), then 1,0,1,0: 5 + 0 + 2 = 7
    assert summary.loc["w0", "preemptions"] == 7
    assert summary.loc["w1", "preemptions"] == 0
    assert summary.loc["w0", "kv_usage"] == pytest.approx(0.8)
    series = worker_series(db_engine, win, bucket_s=300)
    w0 = series[series.worker_id == "w0"]
    assert w0["preemptions"].tolist() == [5.0, 2.0]
    load = lane_load(db_engine, win, bucket_s=300)
    running = load[(load.state == "running") & (load.lanes == "batch")]["requests"]
    assert running.tolist() == [30.0, 30.0]
    only_batch = worker_summary(db_engine, Window(NOW - 600, NOW, lane="batch"))
    assert only_batch["worker_id"].tolist() == ["w1"]


def test_job_progress_and_eta(db_engine):
    jobs = [
        {"id": "batch_a", "status": "in_progress", "endpoint": "/v1/chat/completions",
         "model": MODEL, "created_at": NOW - 700, "in_progress_at": NOW - 600,
         "request_total": 1000, "request_completed": 290, "request_failed": 10},
        {"id": "batch_b", "status": "completed", "endpoint": "/v1/completions",
         "model": MODEL, "created_at": NOW - 300, "in_progress_at": NOW - 290,
         "completed_at": NOW - 100, "request_total": 10, "request_completed": 9,
         "request_failed": 1},
        {"id": "batch_old", "status": "completed", "endpoint": "/v1/completions",
         "model": MODEL, "created_at": NOW - 5 * HOUR, "request_total": 1},
    ]  # fmt: skip
    store(db_engine, jobs=jobs)
    df = job_progress(db_engine, Window(NOW - HOUR, NOW), now=NOW).set_index("id")
    assert list(df.index) == ["batch_b", "batch_a"]
    a = df.loc["batch_a"]
    assert (a.total, a.completed, a.failed) == (1000, 290, 10)
    assert a.done == pytest.approx(0.3)
    assert a.rate_per_s == pytest.approx(0.5)
    assert a.eta_s == pytest.approx(700 / 0.5)
    assert df.loc["batch_b", "done"] == 1.0 and np.isnan(df.loc["batch_b", "eta_s"])


def test_live_figures_feed_the_diagnosis(db_engine):
    """A queue building up in the last 5 minutes: TTFT P99 up, TPOT flat -> queueing advice."""
    rng = np.random.default_rng(1)
    recs = make_records(rng, 300, NOW - HOUR, NOW - 300, "interactive")
    recs += make_records(rng, 60, NOW - 300, NOW, "interactive", Profile(queue=2000))
    snaps = make_snapshots("w0", "interactive", NOW - 300, NOW, waiting=0, kv_usage=0.7)
    snaps[-1]["waiting"] = 40
    store(db_engine, records=recs, snapshots=snaps)
    figs = live_figures(db_engine, Window(NOW - HOUR, NOW))
    assert [f.lane for f in figs] == ["interactive"]
    f = figs[0]
    assert f.requests == 60
    assert f.waiting_now == 40 and f.waiting_before == 0
    base = [r["ttft_ms"] for r in recs if r["finished_at"] < NOW - 300]
    assert f.ttft_p99_baseline_ms == pytest.approx(np.percentile(base, 99))
    findings = diagnose_all(figs)
    assert [(x.symptom, x.cause) for x in findings] == [(Symptom.TTFT_HIGH, Cause.QUEUEING)]
    assert "(waiting 0 -> 40)" in findings[0].advice


def test_live_figures_healthy_traffic_is_quiet(db_engine):
    rng = np.random.default_rng(2)
    recs = make_records(rng, 400, NOW - HOUR, NOW, "interactive")
    recs += make_records(rng, 200, NOW - HOUR, NOW, "batch", Profile(prefill=400, tpot=35))
    snaps = make_snapshots("w0", "interactive,batch", NOW - 300, NOW, kv_usage=0.6)
    store(db_engine, records=recs, snapshots=snaps)
    figs = live_figures(db_engine, Window(NOW - HOUR, NOW))
    assert [f.lane for f in figs] == ["interactive", "batch"]
    assert diagnose_all(figs) == []


def test_live_figures_judge_against_the_slo_targets_the_workers_report(db_engine):
    """Healthy traffic by the default limits (TTFT 1,000 ms), but over the TTFT target its
    workers report: the diagnosis judges against the target (`laneserve status` showed one
    figure, the dashboard another). Each worker's latest target counts, the loosest of them."""
    rng = np.random.default_rng(2)
    recs = make_records(rng, 400, NOW - HOUR, NOW, "interactive")
    snaps = make_snapshots("w0", "interactive", NOW - 300, NOW, kv_usage=0.6)
    snaps += make_snapshots("w1", "interactive", NOW - 300, NOW, kv_usage=0.6)
    for snap in snaps:
        late = snap["at"] >= NOW - 100  # w0 loosened its target later on
        loose = snap["worker_id"] == "w1" or late
        snap |= {"slo_interactive_ttft_ms": 20.0 if loose else 5.0,
                 "slo_interactive_tpot_ms": 1000.0}  # fmt: skip
    store(db_engine, records=recs, snapshots=snaps)
    (fig,) = live_figures(db_engine, Window(NOW - HOUR, NOW, lane="interactive"))
    assert (fig.ttft_target_ms, fig.tpot_target_ms) == (20.0, 1000.0)
    assert fig.ttft_p99_ms > 20.0  # make_records' TTFTs: well under 1,000 ms, over 20
    assert {x.symptom for x in diagnose_all([fig])} == {Symptom.TTFT_HIGH}
    # the batch lane keeps the default limits: its TTFT is queueing behind its job by design
    batch = [dict(s, lanes="batch", slo_batch_ttft_ms=20.0) for s in snaps]
    store(db_engine, records=make_records(rng, 100, NOW - HOUR, NOW, "batch"), snapshots=batch)
    (bfig,) = live_figures(db_engine, Window(NOW - HOUR, NOW, lane="batch"))
    assert bfig.ttft_target_ms is None


def test_empty_database(db_engine):
    win = Window.last(HOUR, now=NOW)
    assert not has_data(db_engine)
    assert latency_summary(db_engine, win).empty
    assert latency_over_time(db_engine, win).empty
    assert latency_histogram(db_engine, win, "e2e").empty
    assert throughput(db_engine, win).empty
    assert slowest_requests(db_engine, win).empty
    assert worker_summary(db_engine, win).empty
    assert lane_load(db_engine, win).empty
    assert job_progress(db_engine, win, now=NOW).empty
    assert live_figures(db_engine, win) == []


def test_window_validation():
    with pytest.raises(QueryError, match="empty window"):
        Window(NOW, NOW)
    with pytest.raises(QueryError, match="unknown lane"):
        Window(NOW - 1, NOW, lane="bulk")
    assert auto_bucket_s(HOUR) == 60
    assert auto_bucket_s(300) == 5
    assert isinstance(pd.Timestamp(0), pd.Timestamp)


def test_live_figures_long_prompt_timeouts(db_engine):
    rng = np.random.default_rng(3)
    recs = make_records(rng, 100, NOW - 290, NOW, "batch")
    slow = make_records(rng, 4, NOW - 290, NOW, "batch", Profile(prompt_tokens=4000))
    for r in slow:
        r.update(status="failed", finish_reason=None, error="deadline_exceeded: 30 s")
    store(db_engine, records=recs + slow)
    (fig,) = live_figures(db_engine, Window(NOW - HOUR, NOW, lane="batch"))
    assert fig.timeouts == 4
    assert fig.timeout_prompt_tokens_p50 == pytest.approx(
        np.percentile([r["prompt_tokens"] for r in slow], 50)
    )
    assert [x.symptom for x in diagnose_all([fig])] == [Symptom.LONG_PROMPT_TIMEOUTS]


def test_percentiles_follow_the_one_latency_rule():
    rng = np.random.default_rng(9)
    for n in (1, 2, 7, 1000):
        vals = rng.gamma(2.0, 50.0, n)
        expected = [percentile(vals.tolist(), q) for q in (50, 90, 99)]
        np.testing.assert_allclose(percentiles(vals), expected, rtol=1e-12)
    assert np.isnan(percentiles(np.array([np.nan]))).all()


def test_current_rates_beside_window_averages(db_engine):
    """The last 30 s against the whole hour: a burst that the hour's average hides."""
    rng = np.random.default_rng(8)
    recs = make_records(rng, 20, NOW - HOUR, NOW - 600, "interactive")
    burst = make_records(rng, 30, NOW - 29, NOW - 1, "interactive")
    store(db_engine, records=recs + burst)
    win = Window(NOW - HOUR, NOW)
    from laneserve.dashboard.queries import request_rows

    (r,) = current_rates(request_rows(db_engine, win), NOW, win).itertuples()
    tokens = sum(x["completion_tokens"] for x in burst)
    assert r.requests == 50
    assert r.tokens_per_s_now == pytest.approx(tokens / 30.0)
    assert r.tokens_per_s_avg == pytest.approx(
        (tokens + sum(x["completion_tokens"] for x in recs)) / HOUR
    )
    assert r.tokens_per_s_now > 50 * r.tokens_per_s_avg
