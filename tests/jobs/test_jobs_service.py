"""jobs.service: files and batches in SQL (SQLite; the lifecycle tests cover PostgreSQL)."""

from __future__ import annotations

import io
import json

import pytest

from laneserve.contracts.openai import Limits
from laneserve.jobs import service
from laneserve.jobs.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)

LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]},
}


def test_create_file_stores_content_under_home(any_engine, laneserve_home):
    data = (json.dumps(LINE) + "\n").encode()
    row = service.create_file(any_engine, data, "in.jsonl")
    assert row.id.startswith("file-") and row.bytes == len(data)
    assert service.file_path(any_engine, row.id).parent == laneserve_home / "files"
    assert service.file_content(any_engine, row.id) == data
    obj = service.file_object(service.get_file(any_engine, row.id))
    assert obj["object"] == "file" and obj["purpose"] == "batch" and obj["filename"] == "in.jsonl"


def test_create_file_limits_and_purpose(any_engine, laneserve_home):
    with pytest.raises(PayloadTooLargeError) as err:
        service.create_file(any_engine, io.BytesIO(b"x" * 5000), "big.jsonl", max_bytes=4096)
    assert err.value.status_code == 413
    assert list((laneserve_home / "files").iterdir()) == []  # nothing left behind
    with pytest.raises(InvalidRequestError):
        service.create_file(any_engine, b"{}", "a.jsonl", purpose="fine-tune")
    with pytest.raises(NotFoundError):
        service.get_file(any_engine, "file-nope")


def test_create_get_list_cancel_batch(any_engine):
    f = service.create_file(any_engine, b"{}\n", "in.jsonl")
    owner = f"owner-{f.id}"  # the PostgreSQL database is shared by the session's tests
    jobs = [
        service.create_batch(any_engine, f.id, "/v1/chat/completions", owner=owner)
        for _ in range(3)
    ]
    job = jobs[0]
    assert job.status == "validating" and job.request_counts == {
        "total": 0,
        "completed": 0,
        "failed": 0,
    }
    assert job.expires_at == pytest.approx(job.created_at + 24 * 3600)
    listed = service.list_batches(any_engine, owner=owner)
    assert [j.id for j in listed] == [
        j.id for j in sorted(jobs, key=lambda j: (j.created_at, j.id), reverse=True)
    ]
    page = service.list_batches(any_engine, limit=1, after=listed[0].id, owner=owner)
    assert [j.id for j in page] == [listed[1].id]
    cancelled = service.cancel_batch(any_engine, job.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert service.cancel_batch(any_engine, job.id).status == "cancelling"  # idempotent
    obj = service.batch_object(service.get_batch(any_engine, job.id))
    assert obj["object"] == "batch" and obj["status"] == "cancelling"
    assert obj["input_file_id"] == f.id and obj["endpoint"] == "/v1/chat/completions"


def test_create_batch_rejects_bad_input(any_engine):
    f = service.create_file(any_engine, b"{}\n", "in.jsonl")
    with pytest.raises(InvalidRequestError, match="endpoint"):
        service.create_batch(any_engine, f.id, "/v1/moderations")
    with pytest.raises(InvalidRequestError, match="completion_window"):
        service.create_batch(any_engine, f.id, "/v1/completions", completion_window="1d")
    with pytest.raises(NotFoundError):
        service.create_batch(any_engine, "file-missing", "/v1/completions")
    with pytest.raises(InvalidRequestError, match="task"):
        service.create_batch(any_engine, f.id, "/v1/chat/completions", task="poem")
    with pytest.raises(InvalidRequestError, match="longer than 512 characters"):  # OpenAI's cap
        service.create_batch(any_engine, f.id, "/v1/completions", metadata={"k": "v" * 513})
    with pytest.raises(NotFoundError):
        service.get_batch(any_engine, "batch_nope")


def test_cancel_of_ended_batch_is_a_conflict(any_engine):
    from laneserve.db.models import Job
    from laneserve.db.session import write_session

    f = service.create_file(any_engine, b"{}\n", "in.jsonl")
    job = service.create_batch(any_engine, f.id, "/v1/completions", completion_window="30m")
    assert job.expires_at == pytest.approx(job.created_at + 1800)
    with write_session(any_engine) as s:
        s.get(Job, job.id).status = "completed"
    with pytest.raises(ConflictError):
        service.cancel_batch(any_engine, job.id)


def test_task_options_go_to_metadata(any_engine):
    f = service.create_file(any_engine, b"{}\n", "docs.jsonl")
    job = service.create_batch(
        any_engine,
        f.id,
        "/v1/chat/completions",
        metadata={"project": "x"},
        task="translate",
        task_options={"target_lang": "fr", "max_tokens": 8},
    )
    assert job.task == "translate"
    assert job.metadata_ == {"project": "x", "target_lang": "fr", "max_tokens": "8"}
    # the user's own metadata key with another value was silently overwritten: now a 400
    with pytest.raises(InvalidRequestError, match="'target_lang' is also a task option") as err:
        service.create_batch(any_engine, f.id, "/v1/chat/completions", task="translate",
                             metadata={"target_lang": "de"}, task_options={"target_lang": "fr"})  # fmt: skip
    assert err.value.param == "metadata"
    same = service.create_batch(any_engine, f.id, "/v1/chat/completions", task="translate",
                                metadata={"target_lang": "fr"}, task_options={"target_lang": "fr"})  # fmt: skip
    assert same.metadata_ == {"target_lang": "fr"}
    # a max_tokens no line could run with is the job's 400, not an error on every line
    for bad in (-5, 0, "abc", "1.5", True, "\u00b2"):  # "²".isdigit(), but no int
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            service.create_batch(
                any_engine, f.id, "/v1/chat/completions", task="summarize",
                task_options={"max_tokens": bad},
            )  # fmt: skip
    ok = service.create_batch(any_engine, f.id, "/v1/chat/completions", task="summarize",
                              task_options={"max_tokens": "12"})  # fmt: skip
    assert ok.metadata_ == {"max_tokens": "12"}
    # above the cap every line is validated with (the runner's), or the caller's lower one
    cap = Limits().max_tokens_limit
    with pytest.raises(InvalidRequestError, match=f"<= {cap}, got {cap + 1}"):
        service.create_batch(any_engine, f.id, "/v1/chat/completions", task="summarize",
                             task_options={"max_tokens": cap + 1})  # fmt: skip
    with pytest.raises(InvalidRequestError, match="<= 100, got 101"):
        service.create_batch(any_engine, f.id, "/v1/chat/completions", task="summarize",
                             task_options={"max_tokens": 101}, max_tokens_limit=100)  # fmt: skip
    at_cap = service.create_batch(any_engine, f.id, "/v1/chat/completions", task="summarize",
                                  task_options={"max_tokens": 100}, max_tokens_limit=100)  # fmt: skip
    assert at_cap.metadata_ == {"max_tokens": "100"}
    # options the runner could not use are the job's 400 too, each naming its field
    for task, options, param in (
        ("translate", {"max_tokens": 8}, "task_options.target_lang"),
        ("summarize", ["max_tokens", 8], "task_options"),
        ("extract", {"schema": {"type": "object"}}, "task_options.schema"),
        ("summarize", {"repetition_penalty": "abc"}, "task_options.repetition_penalty"),
        ("summarize", {"repetition_penalty": 0}, "task_options.repetition_penalty"),
        (
            "translate",
            {"target_lang": "fr", "repetition_penalty": "inf"},
            "task_options.repetition_penalty",
        ),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            service.create_batch(any_engine, f.id, "/v1/chat/completions", task=task,
                                 task_options=options)  # fmt: skip
        assert refused.value.param == param, (task, options, refused.value)
    with pytest.raises(InvalidRequestError) as refused:
        service.create_batch(any_engine, f.id, "/v1/chat/completions", completion_window="1y")
    assert refused.value.param == "completion_window"


def test_task_lines_carry_the_repetition_guard(any_engine):
    """Summarize and translate lines get `TASK_REPETITION_PENALTY` unless the job's
    `repetition_penalty` option says otherwise (1 turns it off); extract lines, held to their
    schema by a grammar, get none. The option is kept in the job's metadata like the others."""
    from laneserve.jobs.prompts import TASK_REPETITION_PENALTY, task_body

    assert TASK_REPETITION_PENALTY > 1.0
    for task, options in (("summarize", {}), ("translate", {"target_lang": "de"})):
        assert (
            task_body(task, "x y", None, options)["repetition_penalty"] == TASK_REPETITION_PENALTY
        )
        off = task_body(task, "x y", None, options | {"repetition_penalty": "1"})
        assert off["repetition_penalty"] == 1.0
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}}'
    assert "repetition_penalty" not in task_body("extract", "x", None, {"schema": schema})
    f = service.create_file(any_engine, b"{}\n", "docs.jsonl")
    job = service.create_batch(any_engine, f.id, "/v1/chat/completions", task="summarize",
                               task_options={"repetition_penalty": 1.3})  # fmt: skip
    assert job.metadata_ == {"repetition_penalty": "1.3"}
