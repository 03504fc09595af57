"""Bulk jobs end to end with real processes: broker + worker + jobs runner."""

from __future__ import annotations

import pytest

from tests.jobs.jobs_stack import JobsStack, chat_line, read_lines, submit, wait_job, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(laneserve_home, db_url):
    s = JobsStack(laneserve_home, db_url)
    yield s
    s.stop()


def test_good_overlength_malformed_nonobject(stack, engine, laneserve_home, smollm2_dir):
    stack.start_broker()
    stack.start_worker()
    stack.start_runner("--max-model-len", "64", model=str(smollm2_dir))
    lines = [chat_line(f"good-{i}", f"Say hello number {i}.") for i in range(5)]
    lines.insert(2, chat_line("too-long", "word " * 200))
    lines.insert(4, '{"custom_id": "broken", "method": "POST", ')  # malformed: not JSON
    lines.append("[1, 2, 3]")  # JSON, not an object
    path = write_jsonl(laneserve_home / "in.jsonl", lines)
    job = submit(engine, path)
    stack.wait_workers(1)
    job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=180)
    assert job.status == "completed", job.errors
    assert job.request_counts == {"total": 8, "completed": 5, "failed": 3}
    out = read_lines(engine, job.output_file_id)
    err = read_lines(engine, job.error_file_id)
    assert sorted(x["custom_id"] for x in out) == [f"good-{i}" for i in range(5)]
    for x in out:
        body = x["response"]["body"]
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] and body["id"] == x["id"]
    errors = {x["custom_id"]: x["error"]["code"] for x in err}
    assert errors == {
        "too-long": "prompt_too_long",
        "line-5": "invalid_json",
        "line-8": "invalid_request",
    }
