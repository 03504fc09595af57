"""The figures the diagnosis reads (`dashboard.diagnose.Figures`) from the recent window's
request and worker frames (see dashboard/queries.py).
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from dashboard.diagnose import Figures
from dashboard.query_rows import LANES, Window, percentiles, request_rows, worker_rows

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


def figures_from_frames(
    lane: str,
    recent: pd.DataFrame,
    baseline: pd.DataFrame,
    workers: pd.DataFrame,
    recent_s: float,
    baseline_s: float,
) -> Figures:
    """`Figures` for one lane from its request rows (recent and baseline) and worker snapshots
    of the recent window (as returned by `request_rows` / `worker_rows`)."""
    timeouts = recent[_is_timeout(recent)] if len(recent) else recent
    tok = recent["completion_tokens"].sum() / recent_s if len(recent) else None
    base_tok = baseline["completion_tokens"].sum() / baseline_s if len(baseline) else None
    waiting_now = waiting_before = running_max = kv = hit = None
    if len(workers):
        first = workers.groupby("worker_id").head(1)["waiting"].sum()
        last = workers.groupby("worker_id").tail(1)
        waiting_now, waiting_before = float(last["waiting"].sum()), float(first)
        running_max = float(workers["running"].max())
        kv = float(workers["kv_usage"].max()) if workers["kv_usage"].notna().any() else None
        hit = (
            float(last["prefix_hit_rate"].mean()) if last["prefix_hit_rate"].notna().any() else None
        )
    return Figures(
        lane=lane,
        requests=len(recent),
        ttft_p99_ms=_p(recent, "ttft_ms", 99),
        ttft_p99_baseline_ms=_p(baseline, "ttft_ms", 99),
        tpot_p50_ms=_p(recent, "tpot_ms", 50),
        tpot_p99_ms=_p(recent, "tpot_ms", 99),
        tpot_p99_baseline_ms=_p(baseline, "tpot_ms", 99),
        itl_p99_ms=_p(recent, "itl_p99_ms", 90),
        queue_p99_ms=_p(recent, "queue_ms", 99),
        prefill_p99_ms=_p(recent, "prefill_ms", 99),
        waiting_now=waiting_now,
        waiting_before=waiting_before,
        running_max=running_max,
        kv_usage_max=kv,
        prefix_hit_rate=hit,
        preemptions=int(recent["preemptions"].fillna(0).sum()) if len(recent) else 0,
        timeouts=len(timeouts),
        timeout_prompt_tokens_p50=_p(timeouts, "prompt_tokens", 50),
        prompt_tokens_p50=_p(recent, "prompt_tokens", 50),
        tokens_per_s=tok,
        tokens_per_s_baseline=base_tok,
    )


def live_figures(
    engine: Engine | None,
    window: Window,
    recent_s: float = 300.0,
    rows: pd.DataFrame | None = None,
    ws: pd.DataFrame | None = None,
) -> list[Figures]:
    """`Figures` per lane: the last `recent_s` of `window` against the part of `window` before it.

    `rows`/`ws` are the window's `request_rows`/`worker_rows` when already read. Lanes without
    any request or snapshot in the window are left out.
    """
    recent_s = min(recent_s, window.seconds)
    split = window.end - recent_s
    rows = request_rows(engine, window) if rows is None else rows
    ws = worker_rows(engine, window) if ws is None else ws
    ws = ws[ws["at"] >= split]
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
                lane, recent, baseline, lane_ws, recent_s, max(split - window.start, 1e-9)
            )
        )
    return out
