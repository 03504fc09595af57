"""The overview's panels: each lays out `queries` frames with `charts` and Streamlit elements.

One function per panel, each taking the `Live` frames of this refresh (the window's requests,
worker snapshots and jobs, read once per fragment run). The per-job view is in `panels_job`,
the worker/SLO/speculation panels in `panels_workers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from laneserve.dashboard import charts, queries
from laneserve.dashboard.diagnose import Figures, Finding, Thresholds, diagnose_all
from laneserve.jobs.errors import error_text

RECENT_S = 300.0  # s: the recent window the diagnosis judges (against the rest of the window)


@dataclass(frozen=True, slots=True)
class Live:
    """What one fragment run reads: the window, its request rows, worker snapshots and jobs,
    the bucket size (s) and the shared time axis; `now` is the window's end (unix seconds)."""

    engine: Engine
    window: queries.Window
    rows: pd.DataFrame
    ws: pd.DataFrame
    jobs: pd.DataFrame
    bucket_s: int
    axis: charts.TimeAxis

    @property
    def now(self) -> float:
        return self.window.end


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _evidence(f: Finding) -> str:
    parts = []
    for name, value in f.evidence.items():
        rule = f.conditions.get(name)
        parts.append(f"{name} = {_fmt(value)}" + (f" (rule: {rule})" if rule else ""))
    return ", ".join(parts)


def _finding_text(f: Finding) -> str:
    share = "" if f.share is None else f" — explains {f.share:.0%} of it"
    return (
        f"**{f.title}**{share}\n\nobserved: {f.observed}\n\n{f.advice}\n\ncheck: {f.check}"
        f"\n\nevidence: _{_evidence(f)}_"
    )


def _healthy_line(fig: Figures, t: Thresholds) -> str:
    ttft = "-" if fig.ttft_p99_ms is None else f"{fig.ttft_p99_ms:,.0f} ms"
    tpot = "-" if fig.tpot_p99_ms is None else f"{fig.tpot_p99_ms:,.0f} ms"
    kv = "-" if fig.kv_usage_max is None else f"{fig.kv_usage_max:.0%}"
    return (
        f"{fig.lane}: {fig.requests} requests, TTFT P99 {ttft} "
        f"({_bound(fig.ttft_target_ms, t.ttft_p99_ms.get(fig.lane))}), "
        f"TPOT P99 {tpot} ({_bound(fig.tpot_target_ms, t.tpot_p99_ms.get(fig.lane))}), "
        f"KV usage max {kv}, preemptions {fig.preemptions}"
    )


def _bound(target: float | None, limit: float | None) -> str:
    """A P99's bound as the diagnosis uses it: the workers' SLO target, else the default."""
    if target is not None:
        return f"SLO target {target:,.0f} ms"
    return "no limit" if limit is None else f"limit {limit:,.0f} ms"


def diagnosis(live: Live, thresholds: Thresholds | None = None) -> None:
    """Findings whose evidence holds, most explaining first; what was checked when healthy."""
    t = thresholds or Thresholds()
    st.header("Diagnosis")
    figs = queries.live_figures(None, live.window, RECENT_S, live.rows, live.ws, live.jobs)
    findings = diagnose_all(figs, t)
    if not findings:
        st.success(f"No symptom in the last {RECENT_S / 60:.0f} minutes.")
        for fig in figs:
            note = " (too few to judge latency)" if fig.requests < t.min_requests else ""
            st.caption(_healthy_line(fig, t) + note)
    for f in findings:
        (st.info if f.by_design else st.warning)(_finding_text(f))
    with st.expander("How the diagnosis decides"):
        st.markdown(rules_text(t))


def rules_text(t: Thresholds) -> str:
    """The thresholds the diagnosis uses, as a Markdown list (shown under the panel)."""
    limits = ", ".join(
        f"{lane} TTFT {t.ttft_p99_ms[lane]:,.0f} ms / TPOT {t.tpot_p99_ms[lane]:,.0f} ms"
        for lane in t.ttft_p99_ms
    )
    return "\n".join([
        f"- It judges the last {RECENT_S / 60:.0f} minutes (at least {t.min_requests} finished "
        "requests per lane).",
        f"- A P99 is **high** above its limit ({limits}; a worker's SLO target replaces it) or "
        f"when {t.ratio:g}x the earlier part of the window and {t.ttft_floor_ms:g} ms (TTFT) / "
        f"{t.tpot_floor_ms:g} ms (TPOT) more.",
        f"- **Queueing** needs queue time >= {t.queue_share:.0%} of TTFT in the slowest 10 % of "
        "requests, or a growing queue. In the batch lane, with interactive traffic running, "
        "that is the design: the note shows each job's ETA against its completion window.",
        f"- **Prefill** needs prefill >= {t.prefill_share:.0%} of TTFT in the slowest 10 %; "
        f"**prefix cache misses** also a cached prompt share < {t.prefix_hit_low:.0%}.",
        f"- **KV memory** needs KV usage >= {t.kv_full:.0%} or preemptions > 0.",
        f"- **Chunks stealing decode steps** needs ITL P99 > {t.jitter_ratio:g}x TPOT P50 and "
        f"chunked prefills (or prompts >= {t.long_prefill_tokens} tokens) in the window.",
        f"- **Throughput flat** needs requests waiting in every snapshot with KV usage < "
        f"{t.kv_low:.0%}.",
        "- Causes are ranked by the share of the symptom they explain.",
    ])  # fmt: skip


def compact(value: float | None, unit: str = "") -> str:
    """A headline figure that fits a narrow column: 3 significant digits at most, thousands as
    k and millions as M (`110,981.2` -> `111k`), then `unit`; "-" when unknown."""
    if value is None or math.isnan(value):
        return "-"
    for scale, suffix in ((1e6, "M"), (1e3, "k"), (1.0, "")):
        if abs(value) >= scale or scale == 1.0:
            v = value / scale
            digits = 0 if abs(v) >= 100 or (v == int(v) and not suffix) else 1
            text = f"{v:.{digits}f}{suffix}"
            break
    return f"{text} {unit}".strip()


def duration_ms(value: float | None) -> str:
    """A latency in its natural unit: `85.3 ms`, `1.2 s`, `111 s`, `3.1 min`."""
    if value is None or math.isnan(value):
        return "-"
    if value < 1000:
        return compact(value, "ms")
    if value < 600_000:
        return compact(value / 1000, "s")
    return compact(value / 60_000, "min")


def summary(live: Live, window_label: str) -> None:
    """Per lane (its name above its row): requests, rates now (last 30 s) beside the window
    averages, latency P99s; short labels and compact values with units, so each fits."""
    rates = queries.current_rates(live.rows, live.now, live.window)
    table = queries.latency_summary(None, live.window, rows=live.rows).set_index(["lane", "metric"])
    now_s = f"{queries.CURRENT_S:.0f} s"
    for r in rates.itertuples():
        st.markdown(f"**{r.lane}**")
        cols = st.columns(6)
        cols[0].metric("requests", f"{r.requests:,}" if r.requests < 1e5 else compact(r.requests),
                       help=f"{r.lane} requests in the {window_label}")  # fmt: skip
        cols[1].metric(
            f"tok/s · last {now_s}",
            compact(r.tokens_per_s_now),
            help=f"output tokens of the {r.lane} requests that finished in the last {now_s}",
        )
        cols[2].metric(
            "tok/s · window avg",
            compact(r.tokens_per_s_avg),
            help=f"output tokens per second averaged over the {window_label}",
        )
        for col, metric, q in zip(cols[3:], ("TTFT", "TPOT", "e2e"), ("p99", "p50", "p99"),
                                  strict=True):  # fmt: skip
            value = table[q].get((r.lane, metric))
            col.metric(f"{metric} {q.upper()}", duration_ms(value),
                       help=f"{r.lane}, over the {window_label}")  # fmt: skip


def latency(live: Live) -> None:
    """TTFT, TPOT, queue, prefill, decode, e2e: percentiles over time and histograms."""
    over_time = queries.latency_over_time(None, live.window, live.bucket_s, rows=live.rows)
    for label in queries.PHASES:
        st.header(label)
        left, right = st.columns([3, 2])
        charts.show(left, charts.latency_lines(over_time, label, live.axis))
        hist = queries.latency_histogram(None, live.window, label, rows=live.rows)
        charts.show(right, charts.latency_histogram(hist, label))


def throughput(live: Live) -> None:
    """Requests and tokens per second per lane; running/waiting per lane group."""
    st.header("Throughput and load")
    rates = queries.throughput(None, live.window, live.bucket_s, rows=live.rows)
    per = f"per {live.bucket_s} s bucket"
    a, b, c = st.columns(3)
    charts.show(
        a,
        charts.rate_lines(rates, "requests_per_s", f"requests/s ({per})", "requests/s", live.axis),
    )
    charts.show(
        b,
        charts.rate_lines(rates, "tokens_per_s", f"output tokens/s ({per})", "tokens/s", live.axis),
    )
    load = queries.lane_load(None, live.window, live.bucket_s, ws=live.ws)
    if load.empty:
        c.info("No worker snapshots in this window.")
    else:
        charts.show(c, charts.lane_load(load, live.axis))


def _eta(seconds: float) -> str:
    if seconds is None or math.isnan(seconds):
        return "ETA -"
    return f"ETA {int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m{int(seconds % 60):02d}s"


def job_title(job) -> str:
    """What a job is, for a person: its id, task (else its endpoint) and input file's name."""
    what = job.task or str(job.endpoint or "").removeprefix("/v1/") or "-"
    return f"{job.id} · {what} · {job.input_file or 'input file gone'}"


def jobs(live: Live) -> None:
    """Progress bars of active and recent bulk jobs (task and input file named), each with a
    link to its own view; a job refused by validation shows its errors instead of `0/0`."""
    st.header("Jobs")
    if live.jobs.empty:
        st.caption("No bulk job in this window.")
    for job in live.jobs.itertuples():
        if job.status == "failed" and job.total == 0:
            why = "; ".join(error_text(e) for e in job.errors or ()) or "no reason stored"
            st.error(f"{job_title(job)} · failed validation, no line ran: {why}")
        else:
            text = (
                f"{job_title(job)} · {job.status} · {job.completed}/{job.total} completed, "
                f"{job.failed} failed · {_eta(job.eta_s)}"
            )
            st.progress(float(job.done), text=text)
        st.markdown(f"[open job {job.id}](?job={job.id})")
    st.caption(retention_line(queries.retention_summary(live.engine)))


def retention_line(r: queries.RetentionSummary) -> str:
    """One line: what the retention passes removed and what is stored."""
    stored = f"stored: {r.stored_files:,} files ({r.stored_bytes / 1e6:,.1f} MB)"
    if r.last_at is None:
        return f"Retention: no pass yet · {stored}"
    last = pd.to_datetime(r.last_at, unit="s", utc=True).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Retention: {r.passes:,} passes, last {last} · pruned {r.files:,} files "
        f"({r.bytes / 1e6:,.1f} MB) and the bodies of {r.lines:,} job lines · {stored}"
    )


def slowest(live: Live) -> None:
    """The slowest requests of the window with their phase breakdown."""
    st.header("Slowest requests")
    top = queries.slowest_requests(None, live.window, n=15, rows=live.rows)
    if top.empty:
        st.caption("No finished request in this window.")
        return
    charts.show(st, charts.phase_breakdown(queries.phase_breakdown(top)))
    st.dataframe(top, hide_index=True)


def live_frames(engine: Engine, window: queries.Window, rows: pd.DataFrame) -> Live:
    """The `Live` of one fragment run: snapshots and jobs read now, `rows` as given."""
    ws = queries.worker_rows(engine, window)
    jobs_df = queries.job_progress(engine, window, now=window.end)
    bucket_s = queries.auto_bucket_s(window.seconds)
    return Live(engine, window, rows, ws, jobs_df, bucket_s,
                charts.TimeAxis(window.start, window.end))  # fmt: skip
