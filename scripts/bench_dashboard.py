#!/usr/bin/env python
"""Dashboard refresh time on a large `requests` table, SQLite and PostgreSQL side by side.

Generates `--rows` finished requests (default 1M) spread over `--span-h` hours up to now (both
lanes, one worker snapshot per worker every 2 s, a running job), migrates a fresh database per
backend, then times what a refresh of the dashboard costs:

- `page_first_s` / `page_refresh_s`: the whole app (`dashboard/app.py` under Streamlit's
  AppTest, every panel and fragment) on its first run and on reruns, for the default window
  (last hour) and for `--wide-window-s` (default the last 6 hours);
- `rows_*_s`: the requests read of a window alone, full and incremental (`dashboard.live_rows`).

Each figure is the median of `--repeats` runs and must stay under the refresh interval
(`--refresh-s`, the app's default 5 s): `under_interval` says whether it does. Prints one JSON
object on stdout.

    python scripts/bench_dashboard.py --rows 1000000 \
        --pg-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from benchlib import cpu_info  # noqa: E402

APP = ROOT / "dashboard" / "app.py"
COLUMNS = (
    "id", "lane", "model", "worker_id", "status", "finish_reason", "attempts", "priority",
    "prompt_tokens", "cached_tokens", "completion_tokens", "preemptions", "prefill_chunks",
    "arrival_at", "finished_at", "queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms",
    "itl_p99_ms", "e2e_ms",
)  # fmt: skip


def request_columns(n: int, start: float, end: float, seed: int = 0) -> dict[str, np.ndarray]:
    """`n` synthetic finished requests (timings consistent with the per-phase definitions)."""
    rng = np.random.default_rng(seed)
    batch = rng.random(n) < 0.4
    queue = rng.exponential(np.where(batch, 400.0, 5.0))
    prefill = rng.gamma(4.0, np.where(batch, 75.0, 20.0))
    completion = rng.integers(1, 128, n)
    tpot = rng.gamma(9.0, np.where(batch, 30.0, 20.0) / 9.0)
    decode = tpot * (completion - 1)
    ttft = queue + prefill + 1.0
    e2e = ttft + decode + 1.0
    finished = np.sort(rng.uniform(start, end, n))
    return {
        "id": np.array([f"cmpl-{uuid.uuid4().hex}" for _ in range(n)], dtype=object),
        "lane": np.where(batch, "batch", "interactive").astype(object),
        "model": np.full(n, "smollm2-135m", dtype=object),
        "worker_id": np.where(rng.random(n) < 0.5, "w0", "w1").astype(object),
        "status": np.full(n, "completed", dtype=object),
        "finish_reason": np.where(rng.random(n) < 0.5, "stop", "length").astype(object),
        "attempts": np.ones(n, dtype=np.int64),
        "priority": np.zeros(n, dtype=np.int64),
        "prompt_tokens": rng.integers(50, 600, n),
        "cached_tokens": np.zeros(n, dtype=np.int64),
        "completion_tokens": completion,
        "preemptions": np.zeros(n, dtype=np.int64),
        "prefill_chunks": np.ones(n, dtype=np.int64),
        "arrival_at": finished - e2e / 1000.0,
        "finished_at": finished,
        "queue_ms": queue,
        "prefill_ms": prefill,
        "ttft_ms": ttft,
        "decode_ms": decode,
        "tpot_ms": np.where(completion >= 2, tpot, np.nan),
        "itl_p99_ms": tpot * 1.5,
        "e2e_ms": e2e,
    }


def _py(v):
    if isinstance(v, float) and v != v:
        return None
    return v.item() if hasattr(v, "item") else v


def fill(url: str, cols: dict[str, np.ndarray], start: float, end: float) -> float:
    """Write the requests (COPY on PostgreSQL, executemany on SQLite), snapshots and a job;
    returns seconds taken."""
    from laneserve.db.migrate import upgrade
    from laneserve.db.session import make_engine

    t0 = time.perf_counter()
    upgrade(url)
    engine = make_engine(url)
    rows = zip(*(cols[c].tolist() for c in COLUMNS), strict=True)
    if engine.dialect.name == "postgresql":
        raw = engine.raw_connection()
        try:
            with (
                raw.cursor() as cur,
                cur.copy(f"COPY requests ({', '.join(COLUMNS)}) FROM STDIN") as cp,
            ):
                for row in rows:
                    cp.write_row([_py(v) for v in row])
            raw.commit()
        finally:
            raw.close()
    else:
        stmt = sa.text(
            f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join(':' + c for c in COLUMNS)})"
        )
        with engine.begin() as conn:
            chunk: list[dict] = []
            for row in rows:
                chunk.append({c: _py(v) for c, v in zip(COLUMNS, row, strict=True)})
                if len(chunk) == 50_000:
                    conn.execute(stmt, chunk)
                    chunk = []
            if chunk:
                conn.execute(stmt, chunk)
    ats = np.arange(start, end, 2.0)
    snaps = [
        {"worker_id": w, "lanes": "interactive,batch", "at": float(t), "running": 12,
         "waiting": 1, "kv_usage": 0.4, "prefix_hit_rate": 0.5, "step_ms": 30.0,
         "tokens_per_s": 300.0, "preemptions": 0}
        for w in ("w0", "w1") for t in ats
    ]  # fmt: skip
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO worker_stats (worker_id, lanes, at, running, waiting, "
                "kv_usage, prefix_hit_rate, step_ms, tokens_per_s, preemptions) "
                "VALUES (:worker_id, :lanes, :at, :running, :waiting, :kv_usage, "
                ":prefix_hit_rate, :step_ms, :tokens_per_s, :preemptions)"
            ),
            snaps,
        )
        conn.execute(sa.text("INSERT INTO jobs (id, status, endpoint, model, created_at, "
                             "in_progress_at, expires_at, request_total, request_completed) "
                             "VALUES ('batch_bench', 'in_progress', '/v1/chat/completions', "
                             f"'smollm2-135m', {end - 600}, {end - 590}, {end + 86000}, "
                             "100000, 4000)"))  # fmt: skip
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("ANALYZE"))
    engine.dispose()
    return time.perf_counter() - t0


def _median(f, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 3)


def measure(url: str, window_s: float, repeats: int) -> dict[str, Any]:
    """Page and row-read times for one window (seconds)."""
    from streamlit.testing.v1 import AppTest

    from laneserve.dashboard import live_rows
    from laneserve.dashboard.queries import Window, request_rows
    from laneserve.db.session import make_engine

    engine = make_engine(url)
    window = Window.last(window_s)
    out: dict[str, Any] = {"window_s": window_s}
    out["rows_read"] = len(request_rows(engine, window))
    out["rows_full_s"] = _median(lambda: request_rows(engine, Window.last(window_s)), repeats)
    cache = live_rows.RowCache()
    cache.read(engine, Window.last(window_s))
    out["rows_incremental_s"] = _median(lambda: cache.read(engine, Window.last(window_s)), repeats)
    engine.dispose()

    os.environ["LANESERVE_DB_URL"] = url
    label = {3600: "last hour", 21600: "last 6 hours", 86400: "last day", 900: "last 15 minutes"}
    at = AppTest.from_file(str(APP), default_timeout=600)
    t0 = time.perf_counter()
    at.run()
    if window_s != 3600:
        at.sidebar.selectbox(key="window").select(label[int(window_s)])
        t0 = time.perf_counter()
        at.run()
    out["page_first_s"] = round(time.perf_counter() - t0, 3)
    assert not at.exception, [e.value for e in at.exception]
    out["page_refresh_s"] = _median(at.run, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--span-h", type=float, default=24.0, help="hours the rows spread over")
    ap.add_argument("--wide-window-s", type=float, default=21600)
    ap.add_argument("--refresh-s", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pg-url", default=None, help="PostgreSQL server URL (skipped when absent)")
    args = ap.parse_args()

    end = time.time()
    start = end - args.span_h * 3600
    t0 = time.perf_counter()
    cols = request_columns(args.rows, start, end)
    gen_s = time.perf_counter() - t0
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"sqlite": f"sqlite:///{Path(tmp) / 'bench.db'}"}
        admin = None
        if args.pg_url:
            name = f"laneserve_bench_{uuid.uuid4().hex[:8]}"
            admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
            urls["postgresql"] = sa.make_url(args.pg_url).set(database=name).render_as_string(False)
        try:
            for backend, url in urls.items():
                fill_s = fill(url, cols, start, end)
                runs = [measure(url, w, args.repeats) for w in (3600.0, args.wide_window_s)]
                for r in runs:
                    worst = max(r["page_refresh_s"], r["rows_incremental_s"])
                    r["under_interval"] = worst < args.refresh_s
                results[backend] = {"fill_s": round(fill_s, 1), "windows": runs}
        finally:
            if admin is not None:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                admin.dispose()
    print(json.dumps({
        "rows": args.rows, "span_h": args.span_h, "refresh_s": args.refresh_s,
        "generate_s": round(gen_s, 1), "backends": results, "cpu": cpu_info(),
        "python": sys.version.split()[0],
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
