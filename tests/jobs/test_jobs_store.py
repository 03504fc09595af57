"""jobs.store: validation inserts, idempotent result writes, counters, files (SQLite + PostgreSQL)."""

from __future__ import annotations

import json

from laneserve.db.models import Job, Request
from laneserve.db.session import read_session, write_session
from laneserve.jobs import results, store
from laneserve.jobs.service import batch_object
from tests.harness import chat_line, read_lines, submit, write_jsonl


def _validated_job(engine, home, n_good=3, bad=("nope",)):
    lines = [chat_line(f"c{i}", f"q{i}") for i in range(n_good)] + list(bad)
    job = submit(engine, write_jsonl(home / "in.jsonl", lines))
    assert store.validate_job(engine, job.id, None, "m") == "in_progress"
    return job


def _ok(job_id, rid):
    return results.success_response(rid, "/v1/chat/completions", "m", _final(rid))


def _final(rid):
    from laneserve.broker import protocol as p

    return p.Final(
        request_id=rid,
        finish_reason="stop",
        text="hi",
        usage={"prompt_tokens": 3, "completion_tokens": 1},
    )


def test_lines_in_order_and_results_counted_once(any_engine, laneserve_home):
    engine = any_engine
    job = _validated_job(engine, laneserve_home)
    assert store.counts(engine, job.id) == (4, 0, 1)  # the bad line is failed at validation
    lines = store.pending_lines(engine, job.id, "", 10)
    assert [pl.custom_id for pl in lines] == ["c0", "c1", "c2"]
    assert [pl.line_no for pl in lines] == [1, 2, 3]
    assert store.pending_lines(engine, job.id, lines[0].rid, 10)[0].custom_id == "c1"
    first = store.Outcome(job.id, lines[0].rid, _ok(job.id, lines[0].rid), 3, 1, "stop")
    assert store.write_outcomes(engine, [first]) == {job.id: (1, 0)}
    assert store.write_outcomes(engine, [first]) == {}  # replayed result: not counted again
    err = store.Outcome(job.id, lines[1].rid, results.error_response("engine_error", "boom"))
    store.write_outcomes(engine, [err])
    assert store.counts(engine, job.id) == (4, 1, 2)
    assert [pl.custom_id for pl in store.pending_lines(engine, job.id, "", 10)] == ["c2"]


def test_cancel_marks_unfinished_and_files_hold_each_line_once(any_engine, laneserve_home):
    engine = any_engine
    job = _validated_job(engine, laneserve_home)
    (line, *_) = store.pending_lines(engine, job.id, "", 10)
    store.write_outcomes(engine, [store.Outcome(job.id, line.rid, _ok(job.id, line.rid))])
    assert store.fail_unfinished(engine, job.id, "batch_cancelled", "cancelled", "cancelled") == 2
    assert store.counts(engine, job.id) == (4, 1, 3)
    file_ids = store.write_result_files(engine, job.id)
    with write_session(engine) as s:
        s.get(Job, job.id).status = "cancelling"
    assert store.end_job(engine, job.id, "cancelled", ("cancelling",), file_ids) == "cancelled"
    out, err = read_lines(engine, file_ids[0]), read_lines(engine, file_ids[1])
    assert [x["custom_id"] for x in out] == ["c0"]
    assert [(x["custom_id"], x["error"]["code"]) for x in err] == [
        ("c1", "batch_cancelled"),
        ("c2", "batch_cancelled"),
        ("line-4", "invalid_json"),
    ]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "hi"
    assert json.dumps(out[0])  # plain JSON
    # a redo after a crash overwrites the same file rows
    assert store.write_result_files(engine, job.id) == file_ids


def test_recount_repairs_counters_from_rows(any_engine, laneserve_home):
    engine = any_engine
    job = _validated_job(engine, laneserve_home, n_good=2)
    assert store.recount(engine, job.id) == (2, 3)  # two lines open: counters left alone
    for pl in store.pending_lines(engine, job.id, "", 10):
        store.write_outcomes(engine, [store.Outcome(job.id, pl.rid, _ok(job.id, pl.rid))])
    with write_session(engine) as s:
        s.get(Job, job.id).request_completed = 0  # corrupt
    assert store.recount(engine, job.id) == (0, 3)
    assert store.counts(engine, job.id) == (3, 2, 1)


def test_revalidation_after_a_crash_replaces_rows(any_engine, laneserve_home):
    engine = any_engine
    job = _validated_job(engine, laneserve_home)
    with write_session(engine) as s:
        s.get(Job, job.id).status = "validating"  # as if the runner died mid-validation
    assert store.validate_job(engine, job.id, None, "m") == "in_progress"
    with read_session(engine) as s:
        n = s.query(Request).filter(Request.job_id == job.id).count()
    assert n == 4 and store.counts(engine, job.id) == (4, 0, 1)


def test_mostly_bad_file_fails_the_job_with_errors(any_engine, laneserve_home):
    engine = any_engine
    wrong_url = {**chat_line("u", "x"), "url": "/v1/moderations"}
    lines = [chat_line("ok", "x"), "bad 1", "[2]", {"custom_id": "no-body"}, wrong_url]
    job = submit(engine, write_jsonl(laneserve_home / "bad.jsonl", lines))
    assert store.validate_job(engine, job.id, None, "m") == "failed"
    with read_session(engine) as s:
        row = s.get(Job, job.id)
        n = s.query(Request).filter(Request.job_id == job.id).count()
    assert row.errors[0]["code"] == "too_many_failed_lines" and "4 of 5" in row.errors[0]["message"]
    assert [e["line"] for e in row.errors[1:]] == [2, 3, 4, 5]
    # the batch object's errors.data items are OpenAI's BatchError: code, line, message, param
    data = batch_object(row)["errors"]["data"]
    assert all(set(e) == {"code", "line", "message", "param"} for e in data)
    assert [e["param"] for e in data] == [None, None, None, "method", "url"]  # first missing
    assert row.request_counts == {"total": 0, "completed": 0, "failed": 0} and n == 0
    assert row.failed_at is not None
