"""`laneserve submit --wait` and `laneserve jobs ...` as real commands against a running stack
(broker + synthetic worker + jobs runner); the CLI finds the database through stack.json."""

from __future__ import annotations

import json
import os
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


def test_submit_wait_show_download_and_exit_codes(laneserve_home, tmp_path):
    from db import migrate

    db_url = f"sqlite:///{tmp_path / 'stack.db'}"  # not the default path: found via stack.json
    migrate.upgrade(db_url)
    (laneserve_home / "stack.json").write_text(json.dumps({"db_url": db_url}))
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker()
        stack.start_jobs_runner()
        lines = [chat_line(f"q{i}", f"question {i}") for i in range(4)] + ["oops"]
        path = write_jsonl(tmp_path / "in.jsonl", lines)
        done = _cli(laneserve_home, "submit", str(path), "--wait")
        assert done.returncode == 0, done.stderr + stack.logs()
        job_id = done.stdout.strip().splitlines()[0]
        assert (
            job_id.startswith("batch_") and "completed (4 completed, 1 failed of 5)" in done.stderr
        )

        shown = _cli(laneserve_home, "jobs", "show", job_id)
        obj = json.loads(shown.stdout)
        assert obj["status"] == "completed" and obj["request_counts"]["total"] == 5

        listed = json.loads(_cli(laneserve_home, "jobs", "list", "--json").stdout)
        assert [b["id"] for b in listed] == [job_id]
        # a unique prefix, as a narrow `jobs list` table may show it, names the job too
        by_prefix = json.loads(_cli(laneserve_home, "jobs", "show", job_id[:12] + "…").stdout)
        assert by_prefix["id"] == job_id
        assert _cli(laneserve_home, "jobs", "show", "batch_").returncode == 1  # too short
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

        assert _cli(laneserve_home, "jobs", "cancel", job_id).returncode == 1  # already ended

        dup = write_jsonl(tmp_path / "dup.jsonl", [chat_line("same", "a"), chat_line("same", "b")])
        failed = _cli(laneserve_home, "submit", str(dup), "--wait")
        assert failed.returncode == 1 and "duplicate_custom_id" in failed.stderr
    finally:
        stack.stop()


def test_submit_rejects_bad_arguments(laneserve_home, tmp_path):
    txt = tmp_path / "doc.txt"
    txt.write_text("hello\n")
    res = _cli(laneserve_home, "submit", str(txt))
    assert res.returncode == 2 and "--task" in res.stderr
    res = _cli(laneserve_home, "submit", str(txt), "--task", "translate")
    assert res.returncode == 2 and "--target-lang" in res.stderr


def test_submit_wait_exits_3_when_the_job_is_cancelled(laneserve_home, tmp_path):
    import time

    from db import migrate

    db_url = f"sqlite:///{laneserve_home / 'laneserve.db'}"  # the default path: no stack.json
    migrate.upgrade(db_url)
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker("w1", "--synthetic-step-ms", "40")
        stack.start_jobs_runner("--max-in-flight", "2")
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
        shown = json.loads(_cli(laneserve_home, "jobs", "show", job_id).stdout)
        assert shown["status"] == "cancelled" and shown["request_counts"]["total"] == 30
    finally:
        stack.stop()
