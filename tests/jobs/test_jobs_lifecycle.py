"""Bulk jobs end to end with real processes: broker + worker + jobs runner (+ recorder).

One test runs the real bundled model: line validation (good, over-long, malformed, non-object,
unpaired-surrogate lines) and a runner SIGKILL mid-job in the same job, each line answered or
refused once. The cancel, expiry, worker-loss, broker-restart and round-robin tests use the
synthetic worker, whose fixed step time makes "in the middle of the job" reliable; the runner
crash on the synthetic worker is checked on PostgreSQL here (and on SQLite, 400 lines, in
tests/reliability/test_reliability_faults.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import Stack, chat_line, read_lines, submit, wait_job, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(laneserve_home, db_url):
    s = Stack.for_jobs(laneserve_home, db_url)
    yield s
    s.stop()


def test_real_model_lines_validate_and_survive_a_runner_sigkill(
    stack, engine, laneserve_home, smollm2_dir
):
    """Good lines are answered by the bundled model on the batch lane, each bad line gets its
    error line, and a runner SIGKILLed mid-job and restarted answers every good line exactly once
    (their timings recorded on the runner's rows)."""
    stack.start_broker(recorder=True)
    stack.start_worker("w1", "--max-num-seqs", "4", model=str(smollm2_dir))  # the real model
    lines = []
    for i in range(12):
        line = chat_line(f"good-{i:02d}", f"Count to {i}.", max_tokens=8)
        line["body"]["min_tokens"] = 8  # fixed length: the job lasts long enough to be hit
        lines.append(line)
    lines.insert(2, chat_line("too-long", "word " * 200))
    lines.insert(4, '{"custom_id": "broken", "method": "POST", ')  # malformed: not JSON
    lines.append("[1, 2, 3]")  # JSON, not an object
    # an unpaired UTF-16 surrogate: valid JSON, no UTF-8 form (the tokenizer refused it, and
    # the job once stayed `validating`, holding every later job back)
    bad = chat_line("surrogate", "x")
    bad["body"]["messages"][0]["content"] = "bad \ud800 text"
    lines.append(json.dumps(bad))  # ensure_ascii: the lone \ud800 escape as written
    job = submit(engine, write_jsonl(laneserve_home / "in.jsonl", lines))
    stack.wait_workers(1, timeout_s=300)
    runner_args = ("--max-model-len", "64", "--max-in-flight", "2")
    stack.start_jobs_runner(*runner_args, model=str(smollm2_dir))
    before = _wait_progress(engine, job.id, 2, stack, timeout_s=180).request_completed
    stack.kill("jobs-runner")
    stack.start_jobs_runner(*runner_args, model=str(smollm2_dir))
    job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=300)
    assert job.status == "completed", job.errors
    assert before < 12 and job.request_counts == {"total": 16, "completed": 12, "failed": 4}
    out = read_lines(engine, job.output_file_id)
    err = read_lines(engine, job.error_file_id)
    assert sorted(x["custom_id"] for x in out) == [f"good-{i:02d}" for i in range(12)]
    for x in out:
        body = x["response"]["body"]
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"].strip() and body["id"] == x["id"]
        assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] > 0
        assert body["service_tier"] == "flex"  # the batch lane served it
    errors = {x["custom_id"]: x["error"]["code"] for x in err}
    assert errors == {
        "too-long": "prompt_too_long",
        "line-5": "invalid_json",
        "line-15": "invalid_request",
        "surrogate": "invalid_json",
    }
    (surrogate,) = [x for x in err if x["custom_id"] == "surrogate"]
    assert "unpaired UTF-16 surrogate" in surrogate["error"]["message"]
    params = {x["custom_id"]: x["error"].get("param") for x in err}
    assert params["too-long"] == "body.messages" and params["line-5"] is None
    _assert_recorded(engine, job.id, 16, timed=12, logs=stack.logs)


def test_a_job_whose_validation_raises_fails_and_later_jobs_still_run(
    stack, engine, laneserve_home
):
    """Validation that raises (here: the stored input file replaced by a directory) is retried
    a few times, then fails that job; a job submitted after it completes meanwhile."""
    from laneserve.db.models import File
    from laneserve.db.session import read_session

    stack.start_broker()
    stack.start_worker("w1", "--synthetic-step-ms", "5")
    broken = submit(engine, write_jsonl(laneserve_home / "a.jsonl", [chat_line("a", "x")]))
    with read_session(engine) as s:
        stored = Path(s.get(File, broken.input_file_id).path)
    stored.unlink()
    stored.mkdir()  # exists, but reading it raises IsADirectoryError
    good = submit(engine, write_jsonl(laneserve_home / "b.jsonl", [chat_line("b", "y")]))
    stack.start_jobs_runner()
    done = wait_job(engine, good.id, ("completed", "failed"), stack, timeout_s=60)
    assert done.status == "completed", done.errors
    failed = wait_job(engine, broken.id, ("failed",), stack, timeout_s=60)
    (error,) = failed.errors
    assert error["code"] == "validation_error" and "IsADirectoryError" in error["message"]
    assert failed.request_total == 0


def _custom_ids(engine, job) -> list[str]:
    return [x["custom_id"] for x in read_lines(engine, job.output_file_id)] + [
        x["custom_id"] for x in read_lines(engine, job.error_file_id)
    ]


def test_duplicate_custom_id_fails_at_validation_and_sends_nothing(stack, engine, laneserve_home):
    stack.start_broker()
    stack.start_worker()
    stack.start_jobs_runner()
    lines = [chat_line(f"c{i}", "hi") for i in range(6)]
    lines[4]["custom_id"] = "c1"  # line 5 repeats line 2's id
    job = submit(engine, write_jsonl(laneserve_home / "dup.jsonl", lines))
    job = wait_job(engine, job.id, ("failed", "completed", "in_progress"), stack)
    assert job.status == "failed"
    assert job.errors[0]["code"] == "duplicate_custom_id"
    assert "lines 2 and 5" in job.errors[0]["message"] and "'c1'" in job.errors[0]["message"]
    assert job.request_counts == {"total": 0, "completed": 0, "failed": 0}
    stack.wait_workers(1)
    assert stack.broker_counters().get("submitted", 0) == 0


def _slow_job(stack, engine, home, n: int, max_tokens: int, recorder: bool = False):
    stack.start_broker(recorder=recorder)
    stack.start_worker("w1", "--synthetic-step-ms", "40")
    lines = [chat_line(f"id-{i:03d}", f"line {i}", max_tokens=max_tokens) for i in range(n)]
    return submit(engine, write_jsonl(home / "slow.jsonl", lines))


def _wait_progress(engine, job_id, at_least: int, stack, timeout_s=90.0):
    import time

    from laneserve.jobs import service

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = service.get_batch(engine, job_id)
        if job.request_completed >= at_least:
            return job
        time.sleep(0.1)
    raise AssertionError(f"no progress on {job_id}\n{stack.logs()}")


def test_cancel_keeps_finished_results(stack, engine, laneserve_home):
    from laneserve.jobs import service

    job = _slow_job(stack, engine, laneserve_home, n=40, max_tokens=25)  # ~1 s a line
    stack.start_jobs_runner("--max-in-flight", "4")
    _wait_progress(engine, job.id, 4, stack)
    service.cancel_batch(engine, job.id)
    job = wait_job(engine, job.id, ("cancelled",), stack, timeout_s=60)
    c = job.request_counts
    assert c["total"] == 40 and 4 <= c["completed"] < 40
    assert c["completed"] + c["failed"] == c["total"]
    out = read_lines(engine, job.output_file_id)
    err = read_lines(engine, job.error_file_id)
    assert len(out) == c["completed"] and all(x["response"]["status_code"] == 200 for x in out)
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert sorted(_custom_ids(engine, job)) == [f"id-{i:03d}" for i in range(40)]


def _assert_recorded(
    engine, job_id: str, n: int, timed: int | None = None, timeout_s=20.0, logs=None
) -> None:
    """The recorder's timings landed on the runner's rows (same request ids), no extra rows."""
    import time

    from sqlalchemy import func, select

    from laneserve.db.models import Request
    from laneserve.db.session import read_session

    deadline = time.monotonic() + timeout_s
    while True:
        with read_session(engine) as s:
            rows = s.execute(
                select(
                    func.count(), func.count(Request.e2e_ms), func.count(Request.response)
                ).where(Request.job_id == job_id)
            ).one()
        timed = n if timed is None else timed
        if rows[1] >= timed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert tuple(rows) == (n, timed, n), logs() if logs else None


def test_worker_lost_after_max_attempts_goes_to_error_file(stack, engine, laneserve_home):
    import time

    stack.start_broker("--max-attempts", "1")
    stack.start_worker("w1", "--synthetic-step-ms", "200")
    stack.start_jobs_runner()
    lines = [chat_line("only", "hello", max_tokens=200)]  # ~40 s on this worker
    job = submit(engine, write_jsonl(laneserve_home / "lost.jsonl", lines))
    deadline = time.monotonic() + 60
    while stack.broker_counters().get("dispatched", 0) < 1:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    stack.kill("worker-w1")
    job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=60)
    assert job.request_counts == {"total": 1, "completed": 0, "failed": 1}
    (err,) = read_lines(engine, job.error_file_id)
    assert err["custom_id"] == "only" and err["error"]["code"] == "worker_lost"
    assert err["error"]["attempts"] == 1


@pytest.mark.postgres
def test_lifecycle_on_postgresql_with_runner_restart(laneserve_home, pg_url):
    from laneserve.db import migrate
    from laneserve.db.session import make_engine

    migrate.upgrade(pg_url)
    engine = make_engine(pg_url)
    stack = Stack.for_jobs(laneserve_home, pg_url)
    try:
        stack.start_broker(recorder=True)
        stack.start_worker("w1", "--synthetic-step-ms", "40")
        lines = [chat_line(f"pg-{i:02d}", f"line {i}", max_tokens=20) for i in range(20)]
        lines[3:3] = ["{broken", '"a string"']
        job = submit(engine, write_jsonl(laneserve_home / "pg.jsonl", lines))
        stack.start_jobs_runner("--max-in-flight", "4")
        _wait_progress(engine, job.id, 4, stack)
        stack.kill("jobs-runner")
        stack.start_jobs_runner("--max-in-flight", "4")
        job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=120)
        assert job.status == "completed"
        assert job.request_counts == {"total": 22, "completed": 20, "failed": 2}
        ids = _custom_ids(engine, job)
        assert sorted(ids) == sorted([f"pg-{i:02d}" for i in range(20)] + ["line-4", "line-5"])
        _assert_recorded(engine, job.id, 22, timed=20)  # bad lines never reach the broker
    finally:
        stack.stop()
        engine.dispose()


def test_expired_job_ends_with_batch_expired_lines(stack, engine, laneserve_home):
    job = _slow_job(stack, engine, laneserve_home, n=20, max_tokens=50)  # ~2 s a line
    from laneserve.db.models import Job
    from laneserve.db.session import write_session

    stack.start_jobs_runner("--max-in-flight", "2")
    _wait_progress(engine, job.id, 1, stack)
    with write_session(engine) as s:  # the 24 h window, run out early
        s.get(Job, job.id).expires_at = 0.0
    job = wait_job(engine, job.id, ("expired",), stack, timeout_s=60)
    c = job.request_counts
    assert c["completed"] >= 1 and c["completed"] + c["failed"] == c["total"] == 20
    assert job.expired_at is not None
    err = read_lines(engine, job.error_file_id)
    assert {x["error"]["code"] for x in err} == {"batch_expired"} and len(err) == c["failed"]
    assert sorted(_custom_ids(engine, job)) == [f"id-{i:03d}" for i in range(20)]


def test_broker_restart_mid_job_resubmits_without_counting_attempts(stack, engine, laneserve_home):
    job = _slow_job(stack, engine, laneserve_home, n=24, max_tokens=20)
    stack.start_jobs_runner("--max-in-flight", "6")
    _wait_progress(engine, job.id, 4, stack)
    stack.kill("broker")
    stack.start_broker("--max-attempts", "1")  # a counted attempt would now fail the line
    job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=120)
    assert job.request_counts == {"total": 24, "completed": 24, "failed": 0}, stack.logs()
    assert sorted(_custom_ids(engine, job)) == [f"id-{i:03d}" for i in range(24)]
    assert "worker_lost" in stack.log("jobs-runner")  # lines were resubmitted


def test_jobs_share_the_window_round_robin(stack, engine, laneserve_home):
    big = _slow_job(stack, engine, laneserve_home, n=60, max_tokens=10)  # ~0.4 s a line
    small_lines = [chat_line(f"s{i}", "hi", max_tokens=10) for i in range(4)]
    small = submit(engine, write_jsonl(laneserve_home / "small.jsonl", small_lines))
    stack.start_jobs_runner("--max-in-flight", "4")
    small = wait_job(engine, small.id, ("completed",), stack, timeout_s=60)
    big_now = wait_job(engine, big.id, ("in_progress", "finalizing", "completed"), stack)
    assert big_now.status == "in_progress" and big_now.request_completed < 60  # small overtook
    big = wait_job(engine, big.id, ("completed",), stack, timeout_s=120)
    assert small.completed_at < big.completed_at


def test_runner_exits_when_its_parent_dies(stack):
    import subprocess
    import time

    parent = subprocess.Popen(["sleep", "60"])
    try:
        stack.start_broker()
        runner = stack.start_jobs_runner("--parent-pid", str(parent.pid))
        time.sleep(1.0)
        assert runner.poll() is None
        parent.kill()
        parent.wait()
        assert runner.wait(timeout=30) == 0, stack.logs()
    finally:
        if parent.poll() is None:
            parent.kill()
