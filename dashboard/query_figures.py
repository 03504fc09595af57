"""The figures the diagnosis reads (`dashboard.diagnose.Figures`) from the recent window's
request and worker frames (see dashboard/queries.py).
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from laneserve.dashboard.diagnose import Figures, JobEta
from laneserve.dashboard.query_rows import LANES, Window, percentiles, request_rows, worker_rows
from laneserve.dashboard.query_workers import ACTIVE_JOB_STATUSES, job_progress

logger = logging.getLogger(__name__)

_TIMEOUT_MARKERS = ("deadline_exceeded", "timeout", "timed out")

# ---------------------------------------------------------------------------------------------
# Diagnosis figures


def _p(rows: pd.DataFrame, col: str, q: int) -> float | None:
    v = percentiles(rows[col], (q,))[0] if len(rows) else float("nan")
    return None if np.isnan(v) else v


def _is_timeout(rows: pd.DataFrame) -> pd.Series:
    text = (
        rows["error"].fillna("").astype(str) + " " + rows["finish_reason"].fillna("").astype(str)
    ).str.lower()
    return text.str.contains("|".join(_TIMEOUT_MARKERS), regex=True)


def _share(part: pd.Series, whole: pd.Series) -> float | None:
    """sum(part) / sum(whole) over the rows that have both (None when there are none)."""
    both = part.notna() & whole.notna()
    total = float(whole[both].sum())
    return float(part[both].sum()) / total if total > 0 else None


def _tail(recent: pd.DataFrame, col: str = "ttft_ms", q: int = 90) -> pd.DataFrame:
    """The slowest requests of `recent` by `col`: at or above its `q`th percentile."""
    cut = _p(recent, col, q)
    return recent.iloc[0:0] if cut is None else recent[recent[col] >= cut]


def _worker_gauges(workers: pd.DataFrame) -> dict[str, float | None]:
    if not len(workers):
        return {}
    last = workers.groupby("worker_id").tail(1)
    per_at = workers.groupby("at")["waiting"].sum()
    return {
        "waiting_now": float(last["waiting"].sum()),
        "waiting_before": float(workers.groupby("worker_id").head(1)["waiting"].sum()),
        "waiting_min": float(per_at.min()),
        "running_max": float(workers["running"].max()),
        "kv_usage_max": (
            float(workers["kv_usage"].max()) if workers["kv_usage"].notna().any() else None
        ),
        "prefix_hit_rate": (
            float(last["prefix_hit_rate"].mean()) if last["prefix_hit_rate"].notna().any() else None
        ),
    }


def figures_from_frames(
    lane: str,
    recent: pd.DataFrame,
    baseline: pd.DataFrame,
    workers: pd.DataFrame,
    recent_s: float,
    baseline_s: float,
    others: pd.DataFrame | None = None,
    jobs: tuple[JobEta, ...] = (),
) -> Figures:
    """`Figures` for one lane from its request rows (recent and baseline), worker snapshots of
    the recent window (as returned by `request_rows` / `worker_rows`), the recent rows of every
    lane (`others`, for the chunked prefills and interactive traffic that share the workers) and
    the active jobs' ETAs."""
    others = recent if others is None else others
    timeouts = recent[_is_timeout(recent)] if len(recent) else recent
    tok = recent["completion_tokens"].sum() / recent_s if len(recent) else None
    base_tok = baseline["completion_tokens"].sum() / baseline_s if len(baseline) else None
    tail = _tail(recent)
    return Figures(
        lane=lane,
        requests=len(recent),
        baseline_requests=len(baseline),
        ttft_p99_ms=_p(recent, "ttft_ms", 99),
        ttft_p99_baseline_ms=_p(baseline, "ttft_ms", 99),
        tpot_p50_ms=_p(recent, "tpot_ms", 50),
        tpot_p99_ms=_p(recent, "tpot_ms", 99),
        tpot_p99_baseline_ms=_p(baseline, "tpot_ms", 99),
        itl_p99_ms=_p(recent, "itl_p99_ms", 90),
        queue_p99_ms=_p(recent, "queue_ms", 99),
        prefill_p99_ms=_p(recent, "prefill_ms", 99),
        queue_share=_share(tail["queue_ms"], tail["ttft_ms"]),
        prefill_share=_share(tail["prefill_ms"], tail["ttft_ms"]),
        preempted_share=float((tail["preemptions"] > 0).mean()) if len(tail) else None,
        cached_share=_share(recent["cached_tokens"], recent["prompt_tokens"]),
        chunked_prefills=int((others["prefill_chunks"] > 1).sum()),
        prompt_tokens_max=float(others["prompt_tokens"].max()) if len(others) else None,
        interactive_requests=int((others["lane"] == "interactive").sum()),
        **_worker_gauges(workers),
        preemptions=int(recent["preemptions"].fillna(0).sum()) if len(recent) else 0,
        timeouts=len(timeouts),
        timeout_prompt_tokens_p50=_p(timeouts, "prompt_tokens", 50),
        prompt_tokens_p50=_p(recent, "prompt_tokens", 50),
        tokens_per_s=tok,
        tokens_per_s_baseline=base_tok,
        jobs=jobs if lane == "batch" else (),
        **_slo_targets(workers, lane),
    )


def _slo_targets(workers: pd.DataFrame, lane: str) -> dict[str, float | None]:
    """The lane's TTFT / TPOT targets (P99 ms) its workers report (`--slo`, or derived from
    their start-up profile): each worker's latest snapshot, the loosest over the workers (a
    lane's requests may run on any of them). None where no worker reports one. Interactive
    only: a batch request's TTFT here is measured from the edge and is mostly queueing behind
    the other lines of its job by design, where a worker's batch target counts from the engine."""
    out: dict[str, float | None] = {"ttft_target_ms": None, "tpot_target_ms": None}
    if workers.empty or lane != "interactive":
        return out
    last = workers.sort_values("at").groupby("worker_id").tail(1)
    for phase in ("ttft", "tpot"):
        col = f"slo_{lane}_{phase}_ms"
        if col in last:
            values = pd.to_numeric(last[col], errors="coerce").dropna()
            out[f"{phase}_target_ms"] = float(values.max()) if len(values) else None
    return out


def job_etas(jobs: pd.DataFrame) -> tuple[JobEta, ...]:
    """The active jobs of a `job_progress` frame as `JobEta`s."""
    active = jobs[jobs["status"].isin(ACTIVE_JOB_STATUSES)]
    return tuple(
        JobEta(str(j.id), _num(j.eta_s), _num(j.window_left_s)) for j in active.itertuples()
    )


def _num(v) -> float | None:
    return None if v is None or pd.isna(v) else float(v)


def live_figures(
    engine: Engine | None,
    window: Window,
    recent_s: float = 300.0,
    rows: pd.DataFrame | None = None,
    ws: pd.DataFrame | None = None,
    jobs: pd.DataFrame | None = None,
) -> list[Figures]:
    """`Figures` per lane: the last `recent_s` of `window` against the part of `window` before it.

    `rows`/`ws`/`jobs` are the window's `request_rows`/`worker_rows`/`job_progress` when already
    read. Lanes without any request or snapshot in the window are left out.
    """
    recent_s = min(recent_s, window.seconds)
    split = window.end - recent_s
    rows = request_rows(engine, window) if rows is None else rows
    ws = worker_rows(engine, window) if ws is None else ws
    jobs = job_progress(engine, window, now=window.end) if jobs is None else jobs
    ws = ws[ws["at"] >= split]
    every_lane = rows[rows["finished_at"] >= split]
    out = []
    for lane in [window.lane] if window.lane else LANES:
        lane_rows = rows[rows["lane"] == lane]
        lane_ws = ws[ws["lanes"].str.contains(lane, regex=False) | (ws["lanes"] == "")]
        if lane_rows.empty and lane_ws.empty:
            continue
        recent = lane_rows[lane_rows["finished_at"] >= split]
        baseline = lane_rows[lane_rows["finished_at"] < split]
        out.append(
            figures_from_frames(
                lane, recent, baseline, lane_ws, recent_s, max(split - window.start, 1e-9),
                others=every_lane, jobs=job_etas(jobs),
            )
        )  # fmt: skip
    return out
