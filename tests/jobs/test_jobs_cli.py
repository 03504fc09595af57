"""`laneserve submit --wait` and `laneserve jobs ...` as real commands against a running stack
(broker + synthetic worker + jobs runner + gateway); the CLI finds the gateway through
stack.json and talks to it over HTTP only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.harness import ROOT, Stack, chat_line, write_jsonl

pytestmark = pytest.mark.slow


def _cli(home, *args, timeout=120):
    env = dict(os.environ, LANESERVE_HOME=str(home), PYTHONPATH=str(ROOT))
    env.pop("LANESERVE_DB_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "laneserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=home,
    )


def start_api(stack: Stack) -> str:
    """The gateway on the stack's broker and database, announced in stack.json as `laneserve
    up` does (this test process stands in for the supervisor); returns its URL."""
    import time

    import httpx

    from laneserve.commands.up_host import free_port
    from laneserve.stack import write_stack

    url = f"http://127.0.0.1:{free_port()}"
    args = ["--broker", stack.front, "--db", stack.db_url, "--port", url.rsplit(":", 1)[1]]
    proc = stack.spawn("api", ["laneserve.commands.api", *args])
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, stack.logs()
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    info = {"state": "ready", "supervisor_pid": os.getpid(), "api_url": url}
    write_stack(info | {"db_url": stack.db_url}, stack.home)
    return url


def test_submit_wait_show_download_and_exit_codes(laneserve_home, tmp_path):
    from laneserve.db import migrate

    db_url = f"sqlite:///{tmp_path / 'stack.db'}"
    migrate.upgrade(db_url)
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker()
        stack.start_jobs_runner()
        api_url = start_api(stack)
        lines = [chat_line(f"q{i}", f"question {i}") for i in range(4)] + ["oops"]
        path = write_jsonl(tmp_path / "in.jsonl", lines)
        done = _cli(laneserve_home, "submit", str(path), "--wait")
        assert done.returncode == 0, done.stderr + stack.logs()
        job_id = done.stdout.strip().splitlines()[0]
        assert (
            job_id.startswith("batch_") and "completed (4 completed, 1 failed of 5)" in done.stderr
        )

        shown = _cli(laneserve_home, "jobs", "show", job_id, "--json")
        obj = json.loads(shown.stdout)
        assert obj["status"] == "completed" and obj["request_counts"]["total"] == 5
        assert obj["stats"]["completion_tokens"] > 0 and obj["stats"]["files"]["errors"]

        listed = json.loads(_cli(laneserve_home, "jobs", "list", "--json").stdout)
        assert [b["id"] for b in listed] == [job_id]
        # a unique prefix, as a narrow `jobs list` table may show it, names the job too
        by_prefix = _cli(laneserve_home, "jobs", "show", job_id[:12] + "…")
        assert by_prefix.stdout.splitlines()[0] == job_id
        assert _cli(laneserve_home, "jobs", "show", "batch_").returncode == 1  # too short
        # its tail, as `laneserve demo` shows a job, names it too
        assert _cli(laneserve_home, "jobs", "show", job_id[-8:]).stdout.splitlines()[0] == job_id
        # --wait shows why lines failed, from the job's error file
        assert "failed line (1 of 1):\n    line-5: invalid_json: not JSON" in done.stderr
        # --wait says where the results are: both files, since one line failed
        assert (
            f"laneserve jobs download {job_id}  (writes ./{job_id}_output.jsonl and "
            f"./{job_id}_errors.jsonl)" in done.stderr
        )
        clean = _cli(laneserve_home, "submit", str(write_jsonl(tmp_path / "ok.jsonl", lines[:2])),
                     "--wait")  # fmt: skip
        assert clean.returncode == 0, clean.stderr
        clean_id = clean.stdout.split()[0]
        assert f"(writes ./{clean_id}_output.jsonl)" in clean.stderr  # no error file promised
        assert "errors" not in clean.stderr
        got = _cli(laneserve_home, "jobs", "download", clean_id)
        assert (
            got.stdout.startswith(f"output: {clean_id}_output.jsonl (")
            and "errors" not in got.stdout
        )
        assert not (laneserve_home / f"{clean_id}_errors.jsonl").exists()

        dl = _cli(
            laneserve_home, "jobs", "download", job_id, "--output", "o.jsonl", "--errors", "e.jsonl"
        )
        assert dl.returncode == 0, dl.stderr
        out = [json.loads(x) for x in (laneserve_home / "o.jsonl").read_text().splitlines()]
        err = [json.loads(x) for x in (laneserve_home / "e.jsonl").read_text().splitlines()]
        assert sorted(x["custom_id"] for x in out) == ["q0", "q1", "q2", "q3"]
        assert [x["custom_id"] for x in err] == ["line-5"]
        # `-`: the file's bytes on stdout (not a file named "-"), what was written on stderr
        piped = _cli(laneserve_home, "jobs", "download", job_id, "--output", "-", "--errors", "e2")
        assert piped.returncode == 0, piped.stderr
        assert piped.stdout == (laneserve_home / "o.jsonl").read_text()
        assert "output: stdout (" in piped.stderr and not (laneserve_home / "-").exists()
        assert (laneserve_home / "e2").read_text() == (laneserve_home / "e.jsonl").read_text()
        both = _cli(laneserve_home, "jobs", "download", job_id, "--output", "-", "--errors", "-")
        assert both.returncode == 2 and "only one of --output and --errors" in both.stderr

        assert _cli(laneserve_home, "jobs", "cancel", job_id).returncode == 1  # already ended

        dup = write_jsonl(
            tmp_path / "dup.jsonl", [chat_line("same", "a"), "not json", chat_line("same", "b")]
        )
        failed = _cli(laneserve_home, "submit", str(dup), "--wait")
        assert failed.returncode == 1, failed.stderr
        # every error, each with the input line it is about
        assert "line 3: duplicate_custom_id: duplicate custom_id 'same' on lines 1 and 3" in (
            failed.stderr
        )
        assert "line 2: invalid_json: not JSON" in failed.stderr
        # no "0 completed, 0 failed of 0": the job never counted its lines
        failed_id = re.search(r"(batch_\w+): failed validation, no line ran; why:\n  line",
                              failed.stderr)  # fmt: skip
        assert failed_id, failed.stderr
        assert f"{failed_id.group(1)}: failed 0/" not in failed.stderr  # no stray progress line
        shown = _cli(laneserve_home, "jobs", "show", failed_id.group(1))
        assert "failed  (failed validation: no line ran)" in shown.stdout, shown.stdout
        assert "line 3: duplicate_custom_id" in shown.stdout

        # a refused batch leaves no uploaded file behind
        files_before = stack_files(api_url)
        docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": "d", "text": "some text"}])
        refused = _cli(laneserve_home, "submit", str(docs), "--task", "summarize",
                       "--max-tokens", "100000")  # fmt: skip
        assert refused.returncode != 0 and "max_tokens must be <= 4096" in refused.stderr
        assert stack_files(api_url) == files_before
    finally:
        stack.stop()


def stack_files(api_url: str) -> list[str]:
    """The ids of the files the API holds (`GET /v1/files`)."""
    import httpx

    res = httpx.get(f"{api_url}/v1/files", timeout=10)
    res.raise_for_status()
    return sorted(f["id"] for f in res.json()["data"])


def test_submit_rejects_bad_arguments(laneserve_home, tmp_path):
    txt = tmp_path / "doc.txt"
    txt.write_text("hello\n")
    res = _cli(laneserve_home, "submit", str(txt))
    assert res.returncode == 2 and "--task" in res.stderr
    res = _cli(laneserve_home, "submit", str(txt), "--task", "translate")
    assert res.returncode == 2 and "--target-lang" in res.stderr
    # task lines without --task: the hint, not the Batch format's missing fields
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"id": "d", "text": "some text"}])
    res = _cli(laneserve_home, "submit", str(docs))
    assert res.returncode == 2 and "add --task summarize|translate|extract|embed" in res.stderr


def test_submit_wait_exits_3_when_the_job_is_cancelled(laneserve_home, tmp_path):
    import time

    from laneserve.db import migrate

    db_url = f"sqlite:///{laneserve_home / 'laneserve.db'}"
    migrate.upgrade(db_url)
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker("w1", "--synthetic-step-ms", "40")
        stack.start_jobs_runner("--max-in-flight", "2")
        start_api(stack)
        lines = [chat_line(f"x{i}", "hi", max_tokens=25) for i in range(30)]  # ~15 s in all
        path = write_jsonl(tmp_path / "in.jsonl", lines)
        env = dict(os.environ, LANESERVE_HOME=str(laneserve_home), PYTHONPATH=str(ROOT))
        waiter = subprocess.Popen(
            [sys.executable, "-m", "laneserve.cli", "submit", str(path), "--wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        job_id = waiter.stdout.readline().strip()
        assert job_id.startswith("batch_")
        time.sleep(3.0)
        cancel = _cli(laneserve_home, "jobs", "cancel", job_id)
        assert cancel.returncode == 0 and "cancelling" in cancel.stdout
        assert waiter.wait(timeout=60) == 3, waiter.stderr.read()
        shown = json.loads(_cli(laneserve_home, "jobs", "show", job_id, "--json").stdout)
        assert shown["status"] == "cancelled" and shown["request_counts"]["total"] == 30
    finally:
        stack.stop()
