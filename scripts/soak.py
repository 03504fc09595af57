#!/usr/bin/env python
"""Soak: mixed traffic for N minutes while the stack's processes are killed (issue 52 item 5).

Starts `laneserve up` (one worker, no dashboard) in a temporary LANESERVE_HOME whose models/ links
to the pulled bundled model (`--synthetic`: synthetic workers), on a fresh PostgreSQL database
reached through a TCP relay (`tests/netrelay.py`; `--pg-url ''`: SQLite, no database restart).
Then, for `--minutes`:

- `--clients` threads send chats and completions to the HTTP API, half of them streaming; a tenth
  of the streams disconnect after their first content chunk. A 429/503 or a connection error is
  retried (at most 5 attempts, honouring Retry-After), as the official `openai` client does;
- a bulk job (`--bulk-lines`, default 20,000 per hour of soak) and a structured-output job (JSON
  schema response_format) run in the batch lane;
- once each, at seeded random moments spread over the middle of the run (one at a time): SIGKILL
  of the worker, the broker, the jobs runner and the recorder (the supervisor restarts them), and
  a PostgreSQL restart as its clients see it (the relay resets every connection and refuses new
  ones for 3 s; the shared server itself is never touched).

Afterwards it waits for both jobs (at most `--drain-timeout` s) and prints one JSON object: the
faults, requests answered / retried / failed by HTTP code, lines lost and duplicated per job,
TTFT/TPOT percentiles (ms, streams) per phase (the window after each fault), and RSS/FDs of
every process over time with their growth after the first 10 % of the run.

    python scripts/soak.py --minutes 60 --clients 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import add_model_home, home_for, stack_info, start_up, stop_up  # noqa: E402
from soak_traffic import Client, summarize_requests  # noqa: E402

KILLED = ("worker-0", "broker", "jobs-runner", "recorder")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
}


# ----------------------------------------------------------------------------- database


class Database:
    """A fresh PostgreSQL database behind a relay (or SQLite when `server_url` is empty)."""

    def __init__(self, server_url: str) -> None:
        self.server_url, self.relay, self.name = server_url, None, ""
        self.url: str | None = None  # None: `laneserve up`'s SQLite

    def __enter__(self) -> Database:
        if not self.server_url:
            return self
        import sqlalchemy as sa

        from tests.netrelay import Relay

        self.name = f"laneserve_soak_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        admin.dispose()
        url = sa.engine.make_url(self.server_url)
        self.relay = Relay(f"{url.host}:{url.port or 5432}")
        host, port = self.relay.start().rsplit(":", 1)
        relayed = url.set(database=self.name, host=host, port=int(port))
        self.url = relayed.render_as_string(hide_password=False)
        return self

    def restart(self, refuse_s: float = 3.0) -> None:
        """What the stack sees of a PostgreSQL restart: every connection reset, none for a while."""
        self.relay.cut()
        time.sleep(refuse_s)
        self.relay.restore()

    def __exit__(self, *exc) -> None:
        if self.relay is None:
            return
        import sqlalchemy as sa

        self.relay.stop()
        admin = sa.create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        admin.dispose()


# ----------------------------------------------------------------------------- jobs


def _job_line(model: str, i: int, max_tokens: int, structured: bool) -> str:
    content = f"Name city number {i} and rank it." if structured else f"Summarize item {i}."
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if structured:
        schema = {"name": "city", "schema": SCHEMA, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    line = {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line)


def _retrying(call, what: str, timeout_s: float = 300.0) -> httpx.Response:
    """`call()` again on a 429/503 or a connection error (the database may be restarting)."""
    deadline, delay = time.monotonic() + timeout_s, 0.5
    while True:
        try:
            resp = call()
            if resp.status_code not in (429, 502, 503, 504):
                resp.raise_for_status()
                return resp
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: no answer in {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(5.0, delay * 2)


def submit_job(api: str, model: str, n: int, max_tokens: int, structured: bool) -> str:
    data = "\n".join(_job_line(model, i, max_tokens, structured) for i in range(n)).encode()
    with httpx.Client(base_url=api, timeout=120) as http:
        files = {"file": ("soak.jsonl", data, "application/jsonl")}
        up = _retrying(lambda: http.post("/v1/files", data={"purpose": "batch"}, files=files),
                       "upload")  # fmt: skip
        body = {"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}  # fmt: skip
        return _retrying(lambda: http.post("/v1/batches", json=body), "batch").json()["id"]


def job_outcome(api: str, job_id: str, n: int, timeout_s: float) -> dict:
    """Wait (bounded) for the job to end; its lines lost, duplicated and failed by code."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=api, timeout=60) as http:
        state = _retrying(lambda: http.get(f"/v1/batches/{job_id}"), "job").json()
        while state["status"] not in ("completed", "failed", "cancelled", "expired"):
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
            state = _retrying(lambda: http.get(f"/v1/batches/{job_id}"), "job").json()
        ids, failed = [], {}
        for key in ("output_file_id", "error_file_id"):
            if not state.get(key):
                continue
            text = _retrying(lambda k=key: http.get(f"/v1/files/{state[k]}/content"), "file").text
            for row in (json.loads(x) for x in text.splitlines() if x.strip()):
                ids.append(row["custom_id"])
                if row.get("error") or (row.get("response") or {}).get("status_code", 200) != 200:
                    code = (row.get("error") or {}).get("code") or "http_error"
                    failed[code] = failed.get(code, 0) + 1
    expected = {f"l{i}" for i in range(n)}
    return {
        "job": job_id,
        "status": state["status"],
        "lines": n,
        "lost": len(expected - set(ids)) if state["status"] == "completed" else None,
        "duplicated": len(ids) - len(set(ids)),
        "unfinished": n - len(set(ids)),
        "failed_by_code": failed,
    }


# ----------------------------------------------------------------------------- faults


def fault_plan(rng: random.Random, duration_s: float, with_db: bool) -> list[tuple[float, str]]:
    """One fault per target, one at a time: seconds after the start, in evenly spaced slots
    over 15-85 % of the run, each moved at random within the middle half of its slot."""
    targets = [*KILLED, *(["postgres"] if with_db else [])]
    rng.shuffle(targets)
    slot = 0.7 * duration_s / len(targets)
    return [
        (0.15 * duration_s + slot * (i + 0.25 + 0.5 * rng.random()), name)
        for i, name in enumerate(targets)
    ]


def inject(name: str, home: Path, db: Database) -> dict:
    if name == "postgres":
        db.restart()
        return {"target": name}
    pid = stack_info(home).get("children", {}).get(name)
    if not pid:
        return {"target": name, "skipped": "not running (restarting)"}
    os.kill(pid, signal.SIGKILL)
    return {"target": name, "pid": pid}


# ----------------------------------------------------------------------------- processes


class ProcessSampler(threading.Thread):
    """RSS (MiB) and open file descriptors of the supervisor and each child, every `every_s`."""

    def __init__(self, home: Path, supervisor_pid: int, t0: float, every_s: float) -> None:
        super().__init__(daemon=True)
        self.home, self.sup, self.t0, self.every_s = home, supervisor_pid, t0, every_s
        self.series: dict[str, list[tuple[float, int, float, int]]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            pids = {"supervisor": self.sup, **stack_info(self.home).get("children", {})}
            for name, pid in pids.items():
                try:
                    proc = psutil.Process(pid)
                    sample = (round(time.time() - self.t0, 1), pid,
                              round(proc.memory_info().rss / 2**20, 1), proc.num_fds())  # fmt: skip
                except (psutil.Error, TypeError):
                    continue
                self.series.setdefault(name, []).append(sample)

    def report(self, after_s: float) -> dict:
        """Per process: growth of its latest pid's RSS and FDs after `after_s` (10 % of the run;
        for a restarted process, `after_s` after its start), and the series thinned to at most
        60 points."""
        out = {}
        for name, samples in self.series.items():
            pid = samples[-1][1]
            mine = [s for s in samples if s[1] == pid]  # a restarted process: once it settled
            late = [s for s in mine if s[0] >= max(after_s, mine[0][0] + after_s)] or mine[-1:]
            first, last = late[0], late[-1]
            step = max(1, len(samples) // 60)
            out[name] = {
                "pids": len({s[1] for s in samples}),
                "rss_mib": [first[2], last[2]],
                "rss_growth_pct": round(100 * (last[2] - first[2]) / max(first[2], 1e-9), 1),
                "fds": [first[3], last[3]],
                "fd_growth": last[3] - first[3],
                "series_t_pid_rss_fds": samples[::step],
            }
        return out


# ----------------------------------------------------------------------------- run


def run_soak(args, home: Path, db: Database) -> dict:
    extra = ["--synthetic"] if args.synthetic else []
    extra += ["--db", db.url] if db.url else []
    proc, info = start_up(home, extra)
    api, duration = info["api_url"], args.minutes * 60
    rng = random.Random(args.seed)
    try:
        model = httpx.get(f"{api}/v1/models", timeout=30).json()["data"][0]["id"]
        bulk = submit_job(api, model, args.bulk_lines, args.max_tokens, structured=False)
        structured = submit_job(api, model, args.structured_lines, 24, structured=True)
        t0 = time.time()
        sampler = ProcessSampler(home, proc.pid, t0, args.sample_every)
        sampler.start()
        clients = [Client(api, model, random.Random(args.seed * 1000 + i), args.max_tokens)
                   for i in range(args.clients)]  # fmt: skip
        for c in clients:
            c.start()
        faults = []
        for at, name in fault_plan(rng, duration, db.url is not None):
            time.sleep(max(0.0, t0 + at - time.time()))
            faults.append({"at_s": round(time.time() - t0, 1), **inject(name, home, db)})
        time.sleep(max(0.0, t0 + duration - time.time()))
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(timeout=150)
        jobs = {
            "bulk": job_outcome(api, bulk, args.bulk_lines, args.drain_timeout),
            "structured": job_outcome(api, structured, args.structured_lines, 120),
        }
        sampler.halt.set()
        records = [r for c in clients for r in c.records]
        return {
            "faults": faults,
            "requests": summarize_requests(records, faults, t0),
            "jobs": jobs,
            "processes": sampler.report(0.1 * duration),
            "restarts": _restarts(home),
        }
    finally:
        stop_up(proc)


def _restarts(home: Path) -> int:
    """Children the supervisor started again, cold or by a standby's takeover."""
    log = (home / "up.log").read_text(errors="replace")
    return log.count(" restarted (pid ") + log.count(" its standby took over (pid ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=64, help="interactive client threads")
    ap.add_argument("--bulk-lines", type=int, help="default: 20,000 per 60 minutes (at least 50)")
    ap.add_argument("--structured-lines", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=52)
    ap.add_argument("--synthetic", action="store_true", help="synthetic workers (fast, for CI)")
    ap.add_argument(
        "--pg-url",
        default=os.environ.get("LANESERVE_TEST_PG_URL", ""),
        help="PostgreSQL server URL (a database is created on it); '' for SQLite",
    )
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for the jobs after the traffic stops",
    )
    ap.add_argument("--sample-every", type=float, default=5.0, help="RSS/FD sampling period, s")
    add_model_home(ap)
    ap.add_argument("--keep", action="store_true", help="keep the soak's home (logs) afterwards")
    args = ap.parse_args()  # fmt: skip
    if args.bulk_lines is None:
        args.bulk_lines = max(50, round(20_000 * args.minutes / 60))
    home = home_for(args.model_home, model_needed=not args.synthetic)
    try:
        with Database(args.pg_url) as db:
            result = run_soak(args, home, db)
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k not in ("pg_url", "model_home")}
    result = {"config": config, "home": str(home) if args.keep else None, **result}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
