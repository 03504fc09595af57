"""Figures that exist only when the workers record them: SLO targets and attainment, the step
budget, predicted step time (`worker_stats`) and speculative decoding (`requests`).

Those columns come with the engine's SLO and speculation features; the dashboard inspects the
tables and shows what is there, and says "not measured" for the rest. A `worker_stats` column is
recognised by its name (`SLO_PATTERNS`, after the SLO controller's columns: `slo_<lane>_ttft_ms`,
`slo_<lane>_tpot_ms`, `slo_<lane>_attainment`, `step_token_budget`, `step_batch_tokens`,
`predicted_step_ms`, `measured_step_ms`); `requests.spec_draft_tokens` and
`requests.spec_accepted_tokens` give the acceptance rate (accepted / drafted tokens), and
`requests.spec_num_drafts` (a later column) the mean accepted length (1 + accepted / drafts).
"""

from __future__ import annotations

import re

import pandas as pd
from sqlalchemy import Engine, inspect, text

from laneserve.dashboard.query_rows import Window, _bucket, auto_bucket_s

# What the SLO panel shows -> a regex over worker_stats column names.
SLO_PATTERNS: dict[str, str] = {
    "SLO attainment": r"^slo_\w+_attainment$",
    "SLO target": r"^slo_\w+_(ttft|tpot)_ms$",
    "step budget": r"^step_(token_budget|batch_tokens)$",
    "predicted step time": r"^(predicted|measured)_step_ms$",
}
SPEC_COLUMNS = ("spec_draft_tokens", "spec_accepted_tokens")


def table_columns(engine: Engine, table: str) -> list[str]:
    """The columns `table` has in the database (not the models': a newer schema may add some)."""
    return [c["name"] for c in inspect(engine).get_columns(table)]


def slo_columns(columns: list[str]) -> dict[str, list[str]]:
    """`SLO_PATTERNS` label -> the `worker_stats` columns whose names match it; a label
    without a match is not measured (a database migrated before the SLO controller)."""
    return {
        label: [c for c in columns if re.search(pattern, c)]
        for label, pattern in SLO_PATTERNS.items()
    }


def _numeric_frame(rows: list[tuple], names: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=names)
    for c in names:
        if c not in ("worker_id", "lane", "lanes"):
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    return df


def slo_series(
    engine: Engine, window: Window, columns: list[str], bucket_s: float | None = None
) -> pd.DataFrame:
    """Bucket means of the given `worker_stats` columns per worker, in long form.

    Columns: bucket (UTC datetime), worker_id, column, value. Empty when `columns` is empty.
    """
    out_cols = ["bucket", "worker_id", "column", "value"]
    if not columns:
        return pd.DataFrame(columns=out_cols)
    for c in columns:  # names come from the inspector; keep them identifiers all the same
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", c), c
    sql = text(
        f"SELECT worker_id, at, {', '.join(columns)} FROM worker_stats "
        "WHERE at >= :start AND at < :end ORDER BY worker_id, at"
    )
    with engine.connect() as conn:
        rows = conn.execute(sql, {"start": window.start, "end": window.end}).fetchall()
    df = _numeric_frame(rows, ["worker_id", "at", *columns])
    if df.empty:
        return pd.DataFrame(columns=out_cols)
    df["bucket"] = _bucket(df["at"], bucket_s or auto_bucket_s(window.seconds))
    means = df.groupby(["bucket", "worker_id"], sort=True)[columns].mean().reset_index()
    long = means.melt(id_vars=["bucket", "worker_id"], var_name="column", value_name="value")
    return long.dropna(subset=["value"])[out_cols]


def has_spec_columns(columns: list[str]) -> bool:
    return all(c in columns for c in SPEC_COLUMNS)


def spec_acceptance(engine: Engine, window: Window, with_drafts: bool = True) -> pd.DataFrame:
    """Speculative decoding per lane over the window: requests with drafts, drafted and
    accepted tokens, acceptance rate (accepted / drafted, 0..1; NaN when nothing was drafted)
    and mean accepted length (tokens a verification emits: 1 + accepted / verifications that
    carried drafts, vLLM's definition; NaN without `requests.spec_num_drafts`, a column that
    `with_drafts=False` leaves out for a database migrated before it, or where no row has it).

    Columns: lane, requests, draft_tokens, accepted_tokens, num_drafts, verified_accepted (the
    accepted tokens of the rows that record verifications), acceptance, mean_accepted_length.
    Needs the `SPEC_COLUMNS` (check `has_spec_columns` first).
    """
    # the length's own numerator: rows recorded before the column existed have no verifications
    drafts = (
        "SUM(spec_num_drafts), "
        "SUM(CASE WHEN spec_num_drafts IS NOT NULL THEN spec_accepted_tokens END)"
        if with_drafts
        else "NULL, NULL"
    )
    sql = text(
        f"SELECT lane, COUNT(*), SUM(spec_draft_tokens), SUM(spec_accepted_tokens), {drafts} "
        "FROM requests WHERE finished_at >= :start AND finished_at < :end "
        "AND spec_draft_tokens > 0 GROUP BY lane ORDER BY lane"
    )
    with engine.connect() as conn:
        rows = conn.execute(sql, {"start": window.start, "end": window.end}).fetchall()
    names = [
        "lane",
        "requests",
        "draft_tokens",
        "accepted_tokens",
        "num_drafts",
        "verified_accepted",
    ]
    df = _numeric_frame(rows, names)
    drafted = df["draft_tokens"].where(df["draft_tokens"] > 0)
    df["acceptance"] = (df["accepted_tokens"] / drafted).astype("float64")
    verified = df["num_drafts"].where(df["num_drafts"] > 0)
    df["mean_accepted_length"] = (1 + df["verified_accepted"] / verified).astype("float64")
    return df
