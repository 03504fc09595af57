#!/usr/bin/env python
"""Recovery time after `kill -9` of a worker during a bulk job, per phase (issue 52 item 4).

Starts `laneserve up` (one worker, no dashboard, SQLite) in a temporary LANESERVE_HOME whose
model directory links to the bundled model already pulled under `$LANESERVE_HOME`, then for
each of `--kills` rounds: submits an N-line job through the HTTP API (`/v1/files`,
`/v1/batches`), waits until `--kill-after` lines are done, SIGKILLs the worker and watches the
recovery every 20 ms (stack.json for the supervisor, the broker's status for the workers and
its counters). Afterwards the SQL rows give the engine's view (first line scheduled and first
line finished after the kill) and the worker's log its start-up milestones. Every phase is
seconds since the kill (wall clock, one host):

    broker_lost       the broker drops the dead worker (its `workers_lost` counter moves)
    requeued          its lines are back in the queue (`requeued` moves)
    restarted         the supervisor has a new worker pid in stack.json
    model_loaded      the new worker's log: weights loaded, the start-up profile begins
    profiled          the new worker's log: the start-up profile is ready (`step cost prior`)
    ready             the broker lists the new worker (its `ready`)
    readmitted        first job line the new engine schedules (requests.first_scheduled_at)
    first_line_done   first job line finished after the kill (requests.finished_at)

Each round kills a worker that has run the supervisor's `stable_s` and has its standby
(laneserve/supervisor.py: a spare that did its imports takes over); `-- --no-standby` measures
a cold restart instead. The killed worker's lines are resumed from the tokens they had
(broker/worker_side.py). Each round also checks that every line came back exactly once. Prints
one JSON object: the rounds and the median of each phase.

    python scripts/bench_recovery.py --kills 3 --lines 200
    python scripts/bench_recovery.py --kills 3 --lines 200 -- --no-standby
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
from benchlib import add_model_home, home_for, stack_info, start_up, stop_up

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = (
    "broker_lost",
    "requeued",
    "restarted",
    "model_loaded",
    "profiled",
    "ready",
    "readmitted",
    "first_line_done",
)
# Worker log lines that mark a start-up milestone (logging's asctime, local time, ms).
LOG_MARKS = {"model_loaded": "weights loaded:", "profiled": "step cost prior"}
STABLE_S = 30.0  # laneserve.supervisor.Supervisor's default stable_s
STANDBY_IMPORTS_S = 10.0  # a standby's imports take ~4 s on a quiet 2-core CPU
_ASCTIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _line(i: int, max_tokens: int) -> str:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": f"Write one sentence about item {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return json.dumps(
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def submit(api: str, lines: int, max_tokens: int) -> str:
    data = "\n".join(_line(i, max_tokens) for i in range(lines)).encode()
    with httpx.Client(base_url=api, timeout=60) as http:
        files = {"file": ("recovery.jsonl", data, "application/jsonl")}
        up = http.post("/v1/files", data={"purpose": "batch"}, files=files)
        up.raise_for_status()
        body = {"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions"}
        batch = http.post("/v1/batches", json=body | {"completion_window": "24h"})
        batch.raise_for_status()
        return batch.json()["id"]


def batch(api: str, job_id: str) -> dict:
    return httpx.get(f"{api}/v1/batches/{job_id}", timeout=30).json()


def wait_batch(api: str, job_id: str, pred, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = batch(api, job_id)
        if pred(state):
            return state
        time.sleep(0.2)
    raise SystemExit(f"job {job_id} stuck: {batch(api, job_id)}")


def watch_recovery(home: Path, front: str, old_pid: int, before: dict, t_kill: float) -> dict:
    """Seconds since the kill at which the broker and the supervisor saw each phase."""
    from laneserve.broker.client import broker_status

    seen: dict[str, float] = {}
    deadline = time.monotonic() + 300
    while len(seen) < 4 and time.monotonic() < deadline:
        if "ready" in seen and time.time() - t_kill > seen["ready"] + 2.0:
            break  # nothing was in flight to requeue
        now = time.time() - t_kill
        new = stack_info(home).get("children", {}).get("worker-0")
        if new and new != old_pid:
            seen.setdefault("restarted", now)
        try:
            st = broker_status(front, timeout_s=1.0)
        except (TimeoutError, OSError):
            st = None
        if st is not None:
            counters = st["counters"]
            if counters.get("workers_lost", 0) > before.get("workers_lost", 0):
                seen.setdefault("broker_lost", now)
            if counters.get("requeued", 0) > before.get("requeued", 0):
                seen.setdefault("requeued", now)
            if new and new != old_pid and any(w["pid"] == new for w in st["workers"]):
                seen.setdefault("ready", now)
        time.sleep(0.02)
    return {k: round(v, 3) for k, v in seen.items()}


def log_marks(path: Path, since: float) -> dict[str, float]:
    """Wall times of the worker's start-up milestones logged after `since`."""
    marks: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _ASCTIME.match(line)
        if not m:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at < since:
            continue
        for phase, text in LOG_MARKS.items():
            if text in line:
                marks.setdefault(phase, round(at - since, 3))
    return marks


def sql_marks(db_url: str, job_id: str, t_kill: float) -> tuple[dict, list[str]]:
    """First line scheduled / finished after the kill, and every custom_id of the output."""
    import sqlalchemy as sa

    from laneserve.db.session import make_engine

    engine = make_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "select min(first_scheduled_at), min(finished_at) from requests "
                "where job_id = :j and first_scheduled_at > :t"
            ),
            {"j": job_id, "t": t_kill},
        ).one()
    engine.dispose()
    out = {}
    if rows[0] is not None:
        out["readmitted"] = round(rows[0] - t_kill, 3)
    if rows[1] is not None:
        out["first_line_done"] = round(rows[1] - t_kill, 3)
    return out, []


def output_ids(api: str, state: dict) -> list[str]:
    ids = []
    for key in ("output_file_id", "error_file_id"):
        if state.get(key):
            text = httpx.get(f"{api}/v1/files/{state[key]}/content", timeout=60).text
            ids += [json.loads(x)["custom_id"] for x in text.splitlines() if x.strip()]
    return ids


def one_kill(home: Path, info: dict, args) -> dict:
    from laneserve.broker.client import broker_status

    api = info["api_url"]
    # the supervisor restarts a worker that ran `stable_s` (30 s) at once, a younger one after a
    # backoff, and hands over to the worker's standby, started once the worker ran `stable_s`:
    # each round measures that kind (or, with --no-standby, a cold start after a stable run).
    # Wait before the job, not after its first lines: a fast engine would finish the job while
    # it waited, leaving nothing to requeue.
    time.sleep(STABLE_S + 1.0)
    standby = "--no-standby" not in args.up_args
    while standby and not stack_info(home).get("standby", {}).get("worker-0"):
        time.sleep(0.2)
    time.sleep(STANDBY_IMPORTS_S if standby else 0.0)
    old = stack_info(home)["children"]["worker-0"]
    job_id = submit(api, args.lines, args.max_tokens)
    wait_batch(api, job_id, lambda s: s["request_counts"]["completed"] >= args.kill_after, 600)
    before = broker_status(info["broker_front"])["counters"]
    t_kill = time.time()
    os.kill(old, signal.SIGKILL)
    phases = watch_recovery(home, info["broker_front"], old, before, t_kill)
    state = wait_batch(api, job_id, lambda s: s["status"] in ("completed", "failed"), 1800)
    phases |= log_marks(home / "logs" / "worker-0.log", t_kill)
    phases |= sql_marks(info["db_url"], job_id, t_kill)[0]
    ids = output_ids(api, state)
    expected = {f"req-{i}" for i in range(args.lines)}
    return {
        "phases_s": {k: phases.get(k) for k in PHASES},
        "status": state["status"],
        "request_counts": state["request_counts"],
        "lost": len(expected - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="rounds (one job and one kill each)")
    ap.add_argument("--lines", type=int, default=200, help="lines per job")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every line")
    ap.add_argument("--kill-after", type=int, default=20, help="lines done before the kill")
    add_model_home(ap)
    ap.add_argument("up_args", nargs="*", help="more `laneserve up` flags (after --)")
    args = ap.parse_args()  # fmt: skip
    home = home_for(args.model_home)
    proc, info = start_up(home, args.up_args)
    try:
        rounds = [one_kill(home, info, args) for _ in range(args.kills)]
    finally:
        stop_up(proc)
    medians = {}
    for phase in PHASES:
        vals = [r["phases_s"][phase] for r in rounds if r["phases_s"][phase] is not None]
        medians[phase] = round(statistics.median(vals), 3) if vals else None
    print(json.dumps({"lines": args.lines, "kills": args.kills, "median_s": medians,
                      "rounds": rounds, "home": str(home)}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
