"""`laneserve up` on the bundled model, used the way a person would: the OpenAI client, a task
job through `laneserve submit`, SQL rows, `laneserve status --json`, `laneserve chat`, and a clean
shutdown. One stack per module (the tests run in file order; the last of them stops it), and
`laneserve down` on a synthetic stack of its own."""

from __future__ import annotations

import io
import json
import os
import select as io_select
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
from rich.console import Console
from sqlalchemy import create_engine, select

from laneserve.commands.status import _print_workers, kv_pool_text
from laneserve.db.models import Request
from tests.harness import ROOT, UpProcess, child_env, laneserve, processes_mentioning, wait_for

pytestmark = pytest.mark.slow

PHASE_COLUMNS = ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "e2e_ms")


# Engine options other than the defaults (and the CPU lane profile), each of which must reach the
# worker (DESIGN.md "Stack discovery").
ENGINE_OPTIONS = {
    "dtype": "float32",
    "max_num_seqs": 16,
    "block_size": 32,
    "max_num_batched_tokens": 64,
    "kv_cache_memory_bytes": 256 * 2**20,
    "interactive_batch_token_cap": 6,
    "batch_token_budget": 48,
}


# A chat holding this text fails inside the engine's step (test-only fault; other chats run).
STEP_FAULT = "STEP-FAULT-41c7"


@pytest.fixture(scope="module")
def up(model_home):
    stack = UpProcess(
        model_home, "--api-port", "0", "--no-dashboard", "--dtype", "float32",
        "--max-num-seqs", "16", "--block-size", "32", "--max-num-batched-tokens", "64",
        "--kv-cache-memory", "256MiB", "--interactive-batch-token-cap", "6",
        "--batch-token-budget", "48",
        env={"LANESERVE_FAULT_STEP": STEP_FAULT},
    )  # fmt: skip
    stack.wait_ready()
    yield stack
    if stack.proc.poll() is None:
        stack.stop()


def client(up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.info["api_url"] + "/v1", api_key="unused", max_retries=0)


def sql_rows(up, *where):
    engine = create_engine(up.info["db_url"])
    try:
        with engine.connect() as conn:
            return conn.execute(select(Request).where(*where)).all()
    finally:
        engine.dispose()


def wait_rows(up, *where, n: int = 1, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    rows = []
    while time.monotonic() < deadline:
        rows = sql_rows(up, *where)
        if len(rows) >= n:
            return rows
        time.sleep(0.3)
    raise AssertionError(f"{len(rows)} of {n} rows after {timeout_s}s:\n{up.logs()}")


def test_stack_json_names_every_component(up):
    info = up.info
    assert set(info["children"]) == {"recorder", "broker", "worker-0", "jobs-runner", "api"}
    assert all(psutil.pid_exists(pid) for pid in info["children"].values())
    assert info["supervisor_pid"] == up.proc.pid
    assert info["db_url"].startswith("sqlite:///") and str(up.home) in info["db_url"]
    assert info["api_url"].startswith("http://127.0.0.1:")
    assert info["dashboard_url"] is None


def test_engine_options_reach_the_worker(up):
    cmd = psutil.Process(up.info["children"]["worker-0"]).cmdline()
    config = json.loads(cmd[cmd.index("--engine-config") + 1])  # one typed config per worker
    assert {k: config[k] for k in ENGINE_OPTIONS} == ENGINE_OPTIONS
    assert config["lanes"] == ["interactive", "batch"]
    assert cmd[cmd.index("--parent-pid") + 1] == str(up.proc.pid)
    env = psutil.Process(up.info["children"]["worker-0"]).environ()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert int(env["OMP_NUM_THREADS"]) >= 1


def test_chat_through_openai_client_is_recorded_with_phases(up):
    c = client(up)
    model = c.models.list().data[0].id
    assert model == "smollm2-135m"
    stream = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip()
    request_id = chunks[0].id
    (row,) = wait_rows(up, Request.id == request_id)
    row = row._mapping
    assert row["lane"] == "interactive"
    assert row["completion_tokens"] >= 2
    for col in PHASE_COLUMNS:
        assert row[col] is not None and row[col] >= 0, col
    assert row["ttft_ms"] >= row["queue_ms"]


def test_task_job_to_completion_via_submit(up, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "text": t}) + "\n"
            for i, t in enumerate(
                [
                    "The json module encodes Python objects as JSON text and decodes it back.",
                    "The csv module reads and writes tables stored as comma separated values.",
                ]
            )
        )
    )
    # Only LANESERVE_HOME tells `submit` where the stack (its database) is.
    res = laneserve(
        up.home, "submit", str(docs), "--task", "summarize", "--max-tokens", "8", "--wait",
        "--json", timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = json.loads(res.stdout.splitlines()[0])["id"]
    show = laneserve(up.home, "jobs", "show", job_id, "--json")
    batch = json.loads(show.stdout)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    rows = wait_rows(up, Request.job_id == job_id, Request.e2e_ms.is_not(None), n=2)
    for row in rows:
        row = row._mapping
        assert row["lane"] == "batch"
        for col in ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "e2e_ms"):
            assert row[col] is not None, col


def test_status_json(up):
    deadline = time.monotonic() + 30  # the worker's first load report follows its first heartbeat
    while True:
        res = laneserve(up.home, "status", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        status = json.loads(res.stdout)  # exactly one JSON object on stdout
        if status["workers"] and all(w.get("load") for w in status["workers"]):
            break
        assert time.monotonic() < deadline, f"no worker load report in 30 s: {status}"
        time.sleep(0.5)
    assert status["running"] is True and status["state"] == "ready"
    (worker,) = status["workers"]
    assert worker["pid"] == up.info["children"]["worker-0"]
    assert "laneserve.commands.worker" in " ".join(psutil.Process(worker["pid"]).cmdline())
    assert worker["lanes"] == ["interactive", "batch"]
    assert worker["model"] == "smollm2-135m"
    assert "kv_usage" in worker["load"]
    # what the worker's engine runs with, as it announced it to the broker
    engine = worker["info"]["engine"]
    assert {k: engine[k] for k in ENGINE_OPTIONS} == ENGINE_OPTIONS
    assert worker["capacity"] == 2 * ENGINE_OPTIONS["max_num_seqs"]
    assert worker["load"]["num_total_blocks"] * 32 * 30 * 3 * 64 * 2 * 4 <= 256 * 2**20
    pool = worker["info"]["kv_pool"]  # the chosen KV numbers, announced and shown in the table
    assert pool["num_blocks"] == worker["load"]["num_total_blocks"] and pool["block_size"] == 32
    console = Console(width=240, record=True, file=io.StringIO())
    _print_workers(console, status)
    assert kv_pool_text(pool) in console.export_text(), console.export_text()
    names = {c["name"]: c for c in status["components"]}
    assert all(c["healthy"] for c in names.values()), names
    assert names["api"]["address"] == up.info["api_url"]


def test_chat_command_streams_an_answer(up):
    res = laneserve(up.home, "chat", "Say hello.", "--max-tokens", "8", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "TTFT" in res.stderr


def test_chat_conversation_sends_the_history(up):
    """`laneserve chat -i`: each line of stdin is a turn sent with every earlier turn and
    answer (the second request's prompt holds the first prompt and the first answer)."""
    since = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "laneserve.cli", "chat", "-i", "--max-tokens", "6",
         "--temperature", "0", "--quiet"],
        input="Name a fruit.\n\nName another one.\n/exit\nnot sent\n", env=child_env(up.home),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip(), res.stderr
    assert res.stdout.endswith("\n\n") and res.stdout.count("\n\n") >= 2  # turns apart
    rows = wait_rows(up, Request.lane == "interactive", Request.arrival_at >= since, n=2)
    first, second = sorted(rows, key=lambda r: r.arrival_at)[:2]
    assert len(rows) == 2  # the blank line is skipped; "/exit" ends before "not sent"
    assert second.prompt_tokens > first.prompt_tokens + first.completion_tokens


def test_chat_command_reports_an_engine_error_and_the_stack_serves_on(up):
    """A request that fails inside the engine's step before its first token gets an HTTP error:
    `laneserve chat` says what failed in one line and exits 1, no traceback; the next chat runs."""
    res = laneserve(up.home, "chat", f"Repeat {STEP_FAULT}", "--max-tokens", "8", "--quiet")
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("laneserve chat: 500: "), res.stderr
    assert "engine step failed" in lines[0] and "Traceback" not in res.stderr, res.stderr
    again = laneserve(up.home, "chat", "Say hello.", "--max-tokens", "4", "--temperature", "0")
    assert again.returncode == 0 and again.stdout.strip(), again.stderr


def test_chat_command_reports_a_worker_lost_mid_answer(up):
    """The worker dies while `laneserve chat` streams (HTTP 200 and text already sent): the stream
    ends with an SSE error event, the command keeps the text it printed, says `worker_lost`-style
    what happened in one stderr line and exits 1; the supervisor restarts the worker and the
    next chat is answered. Seeded sampling: the broker resumes an unseeded or greedy stream on
    the next worker instead (tests/broker/test_broker_processes.py), and a fresh generator
    could not continue this one."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "laneserve.cli", "chat", "Write a long story about a dragon.",
         "--max-tokens", "1500", "--temperature", "0.7", "--seed", "3", "--quiet"],
        env=child_env(up.home), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        first = b""
        deadline = time.monotonic() + 120
        while len(first) < 8 and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = io_select.select([proc.stdout], [], [], 1.0)
            if ready:
                first += os.read(proc.stdout.fileno(), 4096)
        assert len(first) >= 8, (first, proc.poll())
        # this prompt runs for hundreds of steps (the cap is 1,500 tokens): still streaming
        assert proc.poll() is None, ("the answer ended before the kill", first)
        worker = up.stack()["children"]["worker-0"]
        psutil.Process(worker).kill()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 1, (proc.returncode, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("laneserve chat: "), err
    assert "worker" in lines[0] and "Traceback" not in err, err
    assert (first + out).decode().strip()  # the text streamed before the loss stays on stdout

    def restarted():
        new = up.stack()["children"].get("worker-0")
        if new in (None, worker):
            return None
        res = laneserve(up.home, "chat", "Say hello.", "--max-tokens", "4", "--temperature", "0")
        return res if res.returncode == 0 else None

    res = wait_for(restarted, 240, "a restarted worker that answers", poll_s=1.0)
    assert res.stdout.strip()


def test_crashed_child_is_restarted(up):
    old = up.stack()["children"]["jobs-runner"]
    psutil.Process(old).kill()
    deadline = time.monotonic() + 60
    new = None
    while time.monotonic() < deadline:
        new = up.stack()["children"].get("jobs-runner")
        if new and new != old and psutil.pid_exists(new):
            break
        time.sleep(0.3)
    assert new and new != old, up.logs()
    assert "jobs-runner" in (up.home / "up.log").read_text()


def test_sigint_stops_everything(up):
    descendants = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(descendants) >= 5
    assert up.stop(signal.SIGINT) == 0
    gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, alive
    assert not (up.home / "stack.json").exists()
    assert processes_mentioning(str(up.home)) == []
    res = laneserve(up.home, "status", "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["running"] is False


def test_down_stops_the_stack_and_is_idempotent(tmp_path):
    """`laneserve down` (found from LANESERVE_HOME alone) stops the supervisor and every child,
    removes stack.json, and exits 0; run again with nothing running it still exits 0 and says so."""
    stack = UpProcess(tmp_path, "--api-port", "0", "--no-dashboard", "--synthetic")
    try:
        stack.wait_ready()
        descendants = psutil.Process(stack.proc.pid).children(recursive=True)
        assert len(descendants) >= 5
        res = laneserve(tmp_path, "down")
        assert res.returncode == 0 and "stopped" in res.stderr, res.stderr
        assert not psutil.pid_exists(stack.proc.pid) or stack.proc.poll() is not None
        gone, alive = psutil.wait_procs(descendants, timeout=5)
        assert not alive, alive
        assert not (tmp_path / "stack.json").exists()
        # a worker that drained and left on `down` is not reported as lost
        assert "treating as lost" not in (tmp_path / "logs" / "broker.log").read_text()
        again = laneserve(tmp_path, "down")
        assert again.returncode == 0 and "No laneserve stack running" in again.stderr
    finally:
        if stack.proc.poll() is None:
            stack.stop()
