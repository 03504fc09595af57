"""Retention: the jobs runner's pruning pass deletes old job files and clears the line bodies of
jobs that ended before the window, and nothing newer or still running (SQLite + PostgreSQL).

Timestamps are moved into the past through SQL; the pass runs through the runner's own code
path (`JobsRunner.prune_once`, the method its loop calls), and in the slow test through a real
`laneserve jobs-runner` process with `--retention-days`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from laneserve.db.models import File, Job, Request, RetentionPass
from laneserve.db.session import read_session, write_session
from laneserve.jobs import results, retention, service, store
from laneserve.jobs.errors import NotFoundError
from laneserve.jobs.runner import JobsRunner
from tests.harness import Stack, chat_line, submit, wait_job, write_jsonl

DAY_S = 86400.0


def _finished_job(engine, home: Path, tag: str, n: int = 3) -> Job:
    """A job run to `completed` through jobs.store: n lines, the last one failed."""
    from laneserve.broker import protocol as p

    lines = [chat_line(f"{tag}{i}", f"question {tag} {i}") for i in range(n)]
    job = submit(engine, write_jsonl(home / f"{tag}.jsonl", lines))
    assert store.validate_job(engine, job.id, None, "m") == "in_progress"
    outcomes = []
    for k, pl in enumerate(store.pending_lines(engine, job.id, "", 100)):
        if k == n - 1:
            response = results.error_response("engine_error", "boom")
        else:
            final = p.Final(
                request_id=pl.rid,
                finish_reason="stop",
                text="hi",
                usage={"prompt_tokens": 3, "completion_tokens": 1},
            )
            response = results.success_response(pl.rid, "/v1/chat/completions", "m", final)
        outcomes.append(store.Outcome(job.id, pl.rid, response))
    store.write_outcomes(engine, outcomes)
    assert store.begin_finalizing(engine, job.id)
    file_ids = store.write_result_files(engine, job.id)
    assert store.end_job(engine, job.id, "completed", ("finalizing",), file_ids) == "completed"
    return service.get_batch(engine, job.id)


def _file_ids(job: Job) -> list[str]:
    return [f for f in (job.input_file_id, job.output_file_id, job.error_file_id) if f]


def _age(engine, days: float, job: Job | None = None, file_ids=()) -> None:
    """Move a job's times and some files' `created_at` `days` into the past (SQL)."""
    shift = days * DAY_S
    with write_session(engine) as s:
        if job is not None:
            cols = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at")
            s.execute(
                update(Job)
                .where(Job.id == job.id)
                .values({c: getattr(Job, c) - shift for c in cols})
            )
            file_ids = [*file_ids, *_file_ids(job)]
        s.execute(
            update(File)
            .where(File.id.in_(list(file_ids)))
            .values(created_at=File.created_at - shift)
        )


def _paths(engine, file_ids) -> dict[str, Path]:
    with read_session(engine) as s:
        rows = s.execute(select(File.id, File.path).where(File.id.in_(list(file_ids)))).all()
    return {fid: Path(path) for fid, path in rows}


def _bodies(engine, job_id: str) -> tuple[int, int, int]:
    """(line rows, rows that still hold a body, rows whose response is the pruned mark)."""
    with read_session(engine) as s:
        rows = s.execute(
            select(Request.body.is_(None), Request.response).where(Request.job_id == job_id)
        ).all()
    pruned = sum(response == retention.PRUNED_RESPONSE for _, response in rows)
    return len(rows), sum(not cleared for cleared, _ in rows), pruned


def _prune_through_runner(engine, days: float) -> retention.PruneCounts | None:
    runner = JobsRunner(engine, "ipc:///nonexistent", retention_s=days * DAY_S)
    try:
        return asyncio.run(runner.prune_once())
    finally:
        runner._db.shutdown(wait=True)


@pytest.mark.own_database  # the dashboard totals below are over the whole database
def test_pass_prunes_what_is_older_than_the_window_and_nothing_newer(
    any_engine, laneserve_home, caplog, monkeypatch
):
    engine = any_engine
    monkeypatch.setattr(retention, "LINE_CHUNK", 2)  # a job's 3 lines take two transactions
    monkeypatch.setattr(retention, "FILE_CHUNK", 2)  # and the old files several
    old = _finished_job(engine, laneserve_home, "old")
    recent = _finished_job(engine, laneserve_home, "new")
    live = submit(engine, write_jsonl(laneserve_home / "live.jsonl", [chat_line("l0", "q")]))
    assert store.validate_job(engine, live.id, None, "m") == "in_progress"
    orphan = service.create_file(engine, b'{"x": 1}\n', "orphan.jsonl")
    fresh = service.create_file(engine, b'{"x": 2}\n', "fresh.jsonl")
    _age(engine, 45, old)
    _age(engine, 10, recent)
    _age(engine, 400, service.get_batch(engine, live.id))  # old, but has not ended
    _age(engine, 31, file_ids=[orphan.id])

    old_files = _paths(engine, _file_ids(old))
    assert len(old_files) == 3 and all(p.exists() for p in old_files.values())
    kept_ids = [*_file_ids(recent), live.input_file_id, fresh.id]
    kept_files = _paths(engine, kept_ids)
    recent_bytes = sum(p.stat().st_size for p in _paths(engine, _file_ids(recent)).values())
    orphan_path = Path(orphan.path)
    freed = sum(p.stat().st_size for p in old_files.values()) + orphan_path.stat().st_size
    assert _bodies(engine, old.id) == (3, 3, 0)

    with read_session(engine) as s:  # the PostgreSQL database is shared by the test session
        passes_before = s.scalar(select(func.coalesce(func.max(RetentionPass.id), 0)))
    with caplog.at_level(logging.INFO, logger="laneserve.jobs.runner"):
        counts = _prune_through_runner(engine, 30)
    assert counts == retention.PruneCounts(files=4, bytes=freed, lines=3, jobs=1)
    passes = [r.getMessage() for r in caplog.records if "retention pass" in r.getMessage()]
    assert passes == [f"retention pass (older than 30 days): {counts.describe()}"]

    # the old job: files gone (rows and disk), line bodies cleared, the job and its rows kept
    assert not any(p.exists() for p in old_files.values()) and not orphan_path.exists()
    assert _paths(engine, [*old_files, orphan.id]) == {}
    for fid in [*old_files, orphan.id]:
        with pytest.raises(NotFoundError):
            service.get_file(engine, fid)
    assert _bodies(engine, old.id) == (3, 0, 3)  # still finished lines
    after = service.get_batch(engine, old.id)
    assert after.status == "completed" and _file_ids(after) == []
    assert after.request_counts == {"total": 3, "completed": 2, "failed": 1}

    # newer data and a job that has not ended: untouched
    assert _paths(engine, kept_ids) == kept_files and all(p.exists() for p in kept_files.values())
    assert _bodies(engine, recent.id) == (3, 3, 0)
    assert _bodies(engine, live.id) == (1, 1, 0)
    assert service.get_batch(engine, live.id).input_file_id == live.input_file_id
    assert service.file_content(engine, fresh.id) == b'{"x": 2}\n'

    # counted in SQL for the dashboard; a second pass finds nothing
    assert _prune_through_runner(engine, 30) == retention.PruneCounts()
    with read_session(engine) as s:
        rows = s.scalars(
            select(RetentionPass).where(RetentionPass.id > passes_before).order_by(RetentionPass.id)
        ).all()
    assert [(r.files, r.bytes, r.lines, r.jobs, r.older_than_s) for r in rows] == [
        (4, freed, 3, 1, 30 * DAY_S),
        (0, 0, 0, 0, 30 * DAY_S),
    ]
    # a 9-day window reaches the recent job
    assert _prune_through_runner(engine, 9) == retention.PruneCounts(3, recent_bytes, 3, 1)
    assert service.get_batch(engine, live.id).status == "in_progress"
    assert _bodies(engine, live.id) == (1, 1, 0)

    # the dashboard's reading of the counters and of what is stored
    from laneserve.dashboard import panels, queries

    summary = queries.retention_summary(engine)
    assert summary == queries.RetentionSummary(
        passes=3,
        last_at=summary.last_at,
        files=7,
        bytes=freed + recent_bytes,
        lines=6,
        stored_files=2,
        stored_bytes=sum(service.get_file(engine, f).bytes for f in (live.input_file_id, fresh.id)),
    )
    assert abs(summary.last_at - time.time()) < 60
    assert "3 passes" in panels.retention_line(summary)
    assert "pruned 7 files" in panels.retention_line(summary)


def test_input_of_a_recently_ended_job_is_kept_and_bad_windows_raise(engine, laneserve_home):
    job = _finished_job(engine, laneserve_home, "j")
    _age(engine, 60, file_ids=[job.input_file_id])  # uploaded long ago, ran today
    counts = retention.prune(engine, 30 * DAY_S)
    assert (counts.files, counts.lines) == (0, 0)
    assert service.file_content(engine, job.input_file_id)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            retention.prune(engine, bad)


@pytest.mark.slow
def test_runner_process_prunes_with_retention_days(laneserve_home, db_url, engine):
    stack = Stack.for_jobs(laneserve_home, db_url)
    try:
        stack.start_broker()
        stack.start_worker()
        stack.start_jobs_runner("--retention-days", "30", "--retention-interval", "0.3")
        stack.wait_workers(1)
        lines = [chat_line(f"c{i}", f"q{i}") for i in range(4)]
        old = submit(engine, write_jsonl(laneserve_home / "a.jsonl", lines))
        new = submit(engine, write_jsonl(laneserve_home / "b.jsonl", lines))
        old = wait_job(engine, old.id, {"completed"}, stack)
        new = wait_job(engine, new.id, {"completed"}, stack)
        old_paths = _paths(engine, _file_ids(old))
        new_paths = _paths(engine, _file_ids(new))
        assert len(old_paths) == 2 and len(new_paths) == 2  # input + output, no line failed
        _age(engine, 31, old)
        # a pass that read the jobs before the ageing committed deletes the files (read after
        # it) and leaves the bodies to the next pass, 0.3 s later: wait for both
        deadline = time.monotonic() + 60
        while (
            _paths(engine, old_paths) or _bodies(engine, old.id) != (4, 0, 4)
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _paths(engine, old_paths) == {}, stack.logs()
        assert not any(p.exists() for p in old_paths.values())
        assert _bodies(engine, old.id) == (4, 0, 4)
        assert _paths(engine, new_paths) == new_paths
        assert all(p.exists() for p in new_paths.values())
        assert _bodies(engine, new.id) == (4, 4, 0)
        deadline = time.monotonic() + 10
        log = ""
        while "deleted 2 files" not in log and time.monotonic() < deadline:
            time.sleep(0.2)
            log = stack.log("jobs-runner")
        assert "retention pass (older than 30 days): deleted 2 files" in log, log[-3000:]
        assert "cleared the bodies of 4 lines of 1 ended jobs" in log
    finally:
        stack.stop()
