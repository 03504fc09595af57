"""The CLI against a stack in another LANESERVE_HOME, over `--url` and an API key only: submit,
watch (twice: the progress bar re-attaches), show, download, cancel, status, chat, and one clear
line for an unreachable URL, a wrong key and an unknown job.

The CLI runs with its own empty LANESERVE_HOME and a LANESERVE_DB_URL that names no database;
an audit hook in the CLI process records every file it opens and every SQLite connection, and
the test asserts that none touches the stack's home (and, where strace is installed, that no
`open` syscall of the process or its children does either).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import ROOT, UpProcess

pytestmark = pytest.mark.slow

KEY = "remote-cli-key"
LINES = 16
TOKENS = 80  # line i asks for TOKENS * (i + 1): one line ends every ~0.8 s of 10 ms steps

# Runs `laneserve.cli` with an audit hook that logs (at exit) every path opened and every SQLite
# database connected to, as JSON lines in $CLI_AUDIT_LOG.
AUDITED_CLI = """
import atexit, json, os, runpy, sys
log, seen = os.environ.pop("CLI_AUDIT_LOG"), []
def hook(event, args):
    if event in ("open", "os.open") and isinstance(args[0], (str, bytes, os.PathLike)):
        seen.append({"event": event, "path": os.fsdecode(args[0])})
    elif event == "sqlite3.connect":
        seen.append({"event": event, "path": str(args[0])})
def dump():
    with open(log, "a") as f:
        f.writelines(json.dumps(x) + "\\n" for x in seen)
atexit.register(dump)
sys.addaudithook(hook)
sys.argv = ["laneserve", *sys.argv[1:]]
runpy.run_module("laneserve.cli", run_name="__main__")
"""


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A synthetic `laneserve up` with an API key, in its own LANESERVE_HOME."""
    home = tmp_path_factory.mktemp("remote-home")
    up = UpProcess(home, "--synthetic", "--api-port", "0", "--no-dashboard", "--api-key", KEY)
    up.wait_ready(timeout_s=120)
    yield up
    up.stop()


@pytest.fixture
def cli(remote, tmp_path):
    """Run the CLI as a stranger to the stack: its own empty home, no database, the URL and key
    from the environment (or flags); every file it opens is logged (see AUDITED_CLI)."""
    home = tmp_path / "cli-home"
    home.mkdir()
    audit = tmp_path / "audit.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(home))
    env |= {"LANESERVE_DB_URL": f"sqlite:///{tmp_path}/no-such-dir/none.db", "COLUMNS": "200"}
    env |= {"LANESERVE_URL": remote.info["api_url"], "LANESERVE_API_KEY": KEY}

    def run(*args: str, timeout: float = 120.0, strace: Path | None = None, **env_over):
        cmd = [sys.executable, "-c", AUDITED_CLI, *args]
        if strace is not None:
            cmd = ["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(strace)]
            cmd += [sys.executable, "-c", AUDITED_CLI, *args]
        run_env = {k: v for k, v in (env | env_over).items() if v is not None}
        return subprocess.run(
            cmd, env=run_env | {"CLI_AUDIT_LOG": str(audit)}, cwd=home, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip

    run.home = home
    run.env = env | {"CLI_AUDIT_LOG": str(audit)}
    yield run
    opened = [json.loads(x) for x in audit.read_text().splitlines()] if audit.exists() else []
    assert opened, "the audit hook logged nothing: the check would be blind"
    assert not [x for x in opened if x["event"] == "sqlite3.connect"], opened
    touched = [x for x in opened if str(remote.home) in x["path"]]
    assert not touched, f"the CLI opened the stack's files: {touched}"
    assert not (home / "laneserve.db").exists() and not (home / "files").exists()


def _jsonl(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            body = {"model": "synthetic", "messages": [{"role": "user", "content": f"q{i}"}],
                    "max_tokens": TOKENS * (i + 1)}  # fmt: skip
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps(line | {"body": body}) + "\n")
    return path


def _one_clear_line(res: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr


def test_errors_are_one_line_and_non_zero(cli, remote):
    _one_clear_line(cli("jobs", "list", "--api-key", "wrong"), 2, "wrong API key")
    _one_clear_line(cli("jobs", "list", LANESERVE_API_KEY=None), 2, "needs an API key")
    _one_clear_line(cli("submit", "x.jsonl", "--url", "http://127.0.0.1:9"), 2, "no such file")
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    for args in (("jobs", "list"), ("status",), ("chat", "hi"), ("jobs", "watch", "batch_x")):
        _one_clear_line(cli(*args, "--url", dead), 2, "cannot reach", dead)
    for action in ("show", "watch", "cancel", "download"):
        _one_clear_line(cli("jobs", action, "batch_0123456789abcdef"), 1, "no batch")
    _one_clear_line(cli("status", "--api-key", "wrong"), 2, "wrong API key")


def test_submit_watch_twice_show_download_cancel(cli, remote, tmp_path):
    path = _jsonl(tmp_path / "in.jsonl", LINES)
    sub = cli("submit", str(path), "--metadata", "who=remote-test")
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    assert job_id.startswith("batch_") and f"laneserve jobs watch {job_id}" in sub.stderr

    # Watch, stop (as after a Ctrl-C), watch again: both attach to the running job and show it.
    seen = []
    for _ in range(2):
        res = cli("jobs", "watch", job_id, "--timeout", "2")
        assert res.returncode == 124, res.stderr  # stopped watching; the job still runs
        assert f"laneserve jobs watch {job_id} re-attaches" in res.stderr
        progress = [x for x in res.stderr.splitlines() if x.startswith(f"{job_id}: ")]
        progress = [x for x in progress if "tok/s, ETA" in x]
        assert progress and f"/{LINES}, " in progress[-1], res.stderr
        seen.append(int(progress[-1].split("/")[0].rsplit(" ", 1)[1]))
    assert seen[1] >= seen[0], seen

    # Ctrl-C on a watcher: it says the job keeps running and how to re-attach, no traceback.
    # Ctrl-C raises KeyboardInterrupt in the child whatever it inherited: a shell starts
    # background jobs with SIGINT ignored, and a Python started so keeps ignoring it
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + AUDITED_CLI
    watcher = subprocess.Popen(
        [sys.executable, "-c", code, "jobs", "watch", job_id], env=cli.env, cwd=cli.home,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = watcher.stderr.readline()  # the first progress line: the watcher is attached
    assert first.startswith(f"{job_id}: in_progress "), first
    watcher.send_signal(signal.SIGINT)
    rest = watcher.communicate(timeout=30)[1]
    assert watcher.returncode == 130, first + rest
    assert f"{job_id} keeps running (laneserve jobs watch {job_id} re-attaches)" in rest
    assert "Traceback" not in rest

    running = cli("jobs", "show", job_id)
    assert running.returncode == 0, running.stderr
    for field in ("status ", "lines:", "tokens ", "throughput ", "TTFT ms ", "e2e ms ", "ETA "):
        assert field in running.stdout, (field, running.stdout)

    done = cli("jobs", "watch", job_id, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{job_id}: completed ({LINES} completed, 0 failed of {LINES})" in done.stderr

    # the recorder stores each line's latency row on its own path (broker -> recorder), so the
    # last line's row may land just after the job's completion: wait for it (liveness)
    deadline = time.monotonic() + 30
    while True:
        show = cli("jobs", "show", job_id)
        lines = {x.split()[0]: x for x in show.stdout.splitlines()[1:]}
        if f"({LINES} lines)" in lines.get("TTFT", "") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert lines["status"].split()[1] == "completed" and f"{LINES}/{LINES} lines" in show.stdout
    completion = sum(TOKENS * (i + 1) for i in range(LINES))  # synthetic lines run to max_tokens
    assert f"completion {completion}" in lines["tokens"]
    assert float(lines["throughput"].split()[1]) > 0
    ttft, e2e = lines["TTFT"].split(), lines["e2e"].split()
    assert ttft[2] == e2e[2] == "p50" and f"({LINES} lines)" in lines["TTFT"]
    assert float(e2e[3]) >= float(ttft[3]) >= 0  # p50 of e2e >= p50 of TTFT
    assert lines["output"].split()[1].startswith("file-") and lines["errors"].split()[1] == "-"
    as_json = json.loads(cli("jobs", "show", job_id, "--json").stdout)
    assert as_json["metadata"] == {"who": "remote-test"}
    assert as_json["stats"]["completion_tokens"] == completion

    dl = cli("jobs", "download", job_id, "--output", "out.jsonl")
    assert dl.returncode == 0, dl.stderr
    out = [json.loads(x) for x in (cli.home / "out.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(LINES))
    listed = cli("jobs", "list")
    assert job_id in listed.stdout and "completed" in listed.stdout

    second = cli("submit", str(path))
    other = second.stdout.strip()
    deadline = time.monotonic() + 60  # cancel a job whose lines exist (validated), as a user would
    while json.loads(cli("jobs", "show", other, "--json").stdout)["status"] == "validating":
        assert time.monotonic() < deadline, "the second job was never validated"
        time.sleep(0.2)
    cancel = cli("jobs", "cancel", other)
    assert cancel.returncode == 0 and f"{other}: cancelling" in cancel.stdout, cancel.stderr
    ended = cli("jobs", "watch", other, timeout=120)
    assert ended.returncode == 3, ended.stderr  # cancelled
    assert cli("jobs", "cancel", other).returncode == 1  # already ended: 409, one line
    shown = json.loads(cli("jobs", "show", other, "--json").stdout)
    counts = shown["request_counts"]
    assert shown["status"] == "cancelled" and counts["completed"] + counts["failed"] == LINES


def test_submit_wait_status_and_chat(cli, remote, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("First document.\nSecond document.\n")
    trace = tmp_path / "strace.log" if shutil.which("strace") else None
    res = cli("submit", str(docs), "--task", "summarize", "--max-tokens", "4", "--wait",
              "--json", "--api-key", KEY, LANESERVE_API_KEY=None, strace=trace)  # fmt: skip
    assert res.returncode == 0, res.stderr
    batch = json.loads(res.stdout.splitlines()[0])
    assert batch["task"] == "summarize" and "completed (2 completed" in res.stderr
    if trace is not None:  # every open syscall of the CLI and its children, not only Python's
        opens = trace.read_text().splitlines()
        assert len(opens) > 10, opens
        assert not [x for x in opens if str(remote.home) in x], "the CLI opened the stack's files"

    status = cli("status", "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["remote"] is True and view["running"] is True and view["ready"] is True
    (worker,) = view["workers"]
    assert worker["pid"] == remote.info["children"]["worker-0"]
    assert worker["lanes"] == ["interactive", "batch"] and view["model"] == "synthetic"
    table = cli("status")
    assert table.returncode == 0 and "ready" in table.stdout and "worker-0" in table.stdout

    chat = cli("chat", "hello", "--max-tokens", "4")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() and "TTFT" in chat.stderr
    # the synthetic worker always runs to max_tokens: the CLI says the answer was cut there
    assert "the answer was cut at --max-tokens 4" in chat.stderr


def test_progress_bar_on_a_terminal_reattaches(remote, tmp_path):
    """In-process `follow` with a terminal console: the rich bar shows done/total, failed, tok/s
    and ETA, and a second `follow` on the same job starts from its progress."""
    import io

    from rich.console import Console

    from laneserve.commands.jobs import follow
    from laneserve.http_client import StackClient, Target

    with StackClient(Target(remote.info["api_url"], KEY, local=False)) as client:
        with _jsonl(tmp_path / "in.jsonl", 8).open("rb") as f:
            file = client.upload_file(f, "in.jsonl")
        job = client.create_batch({"input_file_id": file["id"], "endpoint": "/v1/chat/completions"})
        texts = []
        for timeout_s in (1.5, 1.5, None):
            out = io.StringIO()
            console = Console(file=out, force_terminal=True, width=120)
            last = follow(client, job["id"], console=console, timeout_s=timeout_s, poll_s=0.2)
            texts.append(out.getvalue())
        assert last["status"] == "completed"
    for text in texts:
        assert "/8" in text and "failed 0" in text and "tok/s" in text and "ETA" in text
    assert "8/8" in texts[-1] and "completed" in texts[-1]


def test_local_status_of_a_stack_with_an_api_key_needs_no_key(remote):
    """On the stack's own machine (its LANESERVE_HOME, no URL) `laneserve status` reads the
    workers from the broker and readiness from the API's open probe: no key needed, and no
    "API not ready" under "laneserve ready" (it said the key was missing and exited 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LANESERVE_URL", "LANESERVE_API_KEY")}
    env |= {"PYTHONPATH": str(ROOT), "LANESERVE_HOME": str(remote.home), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "laneserve.cli", "status"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "laneserve ready" in res.stdout and "not ready" not in res.stdout, res.stdout
    res = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.stdout, res.stderr)
    status = json.loads(res.stdout)
    assert status["ready"] is True and status["reason"] is None and status["workers"], status
