"""SQL operations of the jobs runner: job lines in `requests`, counters and status in `jobs`.

Every write is one short transaction (`db.session.write_session`). A job line is a `requests`
row whose `id` is `request_id(job_id, line_no)`: ids sort in line order, so the runner pages
through a job's lines with a primary-key range scan, and a line keeps one id across attempts
and restarts. A line is finished exactly when its `response` is not NULL (the `status` column
is also written by the recorder, so it is informational only). Result writes only fill a NULL
`response` and bump the job's counters in the same transaction, so a result delivered twice is
counted once.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, insert, select, update

from laneserve.db.models import File, Job, Request
from laneserve.db.session import read_session, write_session
from laneserve.jobs import files, results
from laneserve.jobs.validate import JobValidationError, LineResult, Validator

logger = logging.getLogger(__name__)

ACTIVE_STATUSES = ("validating", "in_progress", "cancelling", "finalizing")
INSERT_CHUNK = 500
PAGE = 1000


def request_id(job_id: str, line_no: int) -> str:
    """The request id of line `line_no` (1-based) of a job: sortable in line order."""
    return f"batch_req_{job_id.removeprefix('batch_')}_{line_no:08d}"


def _id_range(job_id: str) -> tuple[str, str]:
    prefix = request_id(job_id, 0)[:-8]
    return prefix, prefix + "~"  # '~' sorts after every digit


@dataclass(slots=True)
class JobInfo:
    id: str
    status: str
    endpoint: str
    model: str | None
    task: str | None
    expires_at: float | None


@dataclass(slots=True)
class PendingLine:
    rid: str
    custom_id: str
    line_no: int
    request: dict[str, Any]


@dataclass(slots=True)
class Outcome:
    """A finished line, to be written: `response` per `jobs.results`."""

    job_id: str
    rid: str
    response: dict[str, Any]
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


def active_jobs(engine: Engine) -> list[JobInfo]:
    """Jobs the runner has work for, oldest first."""
    query = (
        select(Job.id, Job.status, Job.endpoint, Job.model, Job.task, Job.expires_at)
        .where(Job.status.in_(ACTIVE_STATUSES))
        .order_by(Job.created_at)
    )
    with read_session(engine) as session:
        return [JobInfo(*row) for row in session.execute(query)]


def counts(engine: Engine, job_id: str) -> tuple[int, int, int]:
    """(total, completed, failed) of a job."""
    with read_session(engine) as session:
        row = session.execute(
            select(Job.request_total, Job.request_completed, Job.request_failed).where(
                Job.id == job_id
            )
        ).one()
    return row[0], row[1], row[2]


def recount(engine: Engine, job_id: str) -> tuple[int, int]:
    """Recompute a job's counters from its rows; returns (unfinished lines, rows).

    Repairs counters that disagree with the rows (they never should: results and counters are
    written in one transaction); `completed`/`failed` are set only when no line is unfinished.
    """
    with write_session(engine) as session:
        rows = session.execute(select(Request.response).where(Request.job_id == job_id)).scalars()
        total = unfinished = failed = 0
        for response in rows:
            total += 1
            if response is None:
                unfinished += 1
            elif results.is_error(response):
                failed += 1
        if unfinished == 0:
            session.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(
                    request_total=total,
                    request_completed=total - failed,
                    request_failed=failed,
                )
            )
    return unfinished, total


# --------------------------------------------------------------------------------- validation


def validate_job(engine: Engine, job_id: str, counter, default_model: str | None) -> str:
    """Validate a `validating` job and insert its lines; returns the job's new status
    (`in_progress`, `failed`, or the status a concurrent cancel left).

    Re-runnable after a crash: rows of a previous, interrupted validation are deleted first.
    """
    with read_session(engine) as session:
        job = session.get(Job, job_id)
        path = Path(session.get(File, job.input_file_id).path) if job.input_file_id else None
    meta = job.metadata_ or {}
    validator = Validator(
        endpoint=job.endpoint,
        counter=counter,
        task=job.task,
        task_options={
            k: meta[k]
            for k in ("target_lang", "source_lang", "max_tokens", "schema", "repetition_penalty")
            if k in meta
        },
        default_model=job.model or default_model,
    )
    _delete_lines(engine, job_id)
    try:
        if path is None or not path.exists():
            raise JobValidationError(
                [{"code": "invalid_file", "message": "input file is missing", "line": None}]
            )
        chunk: list[LineResult] = []
        for result in validator.lines(path):
            chunk.append(result)
            if len(chunk) >= INSERT_CHUNK:
                _insert_lines(engine, job_id, chunk, validator.model)
                chunk = []
        _insert_lines(engine, job_id, chunk, validator.model)
        if validator.too_many_bad():
            raise JobValidationError(validator.job_errors())
    except JobValidationError as exc:
        _delete_lines(engine, job_id)
        logger.info("job %s failed validation: %s", job_id, exc)
        return _set_failed(engine, job_id, exc.errors)
    with write_session(engine) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                model=validator.model,
                request_total=validator.num_lines,
                request_completed=0,
                request_failed=validator.num_bad,
            )
        )
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "validating")
            .values(status="in_progress", in_progress_at=time.time())
        )
        status = session.scalar(select(Job.status).where(Job.id == job_id))
    logger.info(
        "job %s validated: %d lines, %d bad -> %s",
        job_id,
        validator.num_lines,
        validator.num_bad,
        status,
    )
    return status


def _delete_lines(engine: Engine, job_id: str) -> None:
    with write_session(engine) as session:
        session.execute(delete(Request).where(Request.job_id == job_id))


def _insert_lines(engine: Engine, job_id: str, chunk: list[LineResult], model: str | None) -> None:
    good, bad = [], []
    for r in chunk:
        row = {
            "id": request_id(job_id, r.line_no),
            "job_id": job_id,
            "custom_id": r.custom_id,
            "line_no": r.line_no,
            "lane": "batch",
            "model": model,
            "prompt_tokens": r.prompt_tokens,
        }
        if r.error is not None:
            row.update(status="failed", response=results.error_response(**r.error), body=None)
            bad.append(row)
        else:
            row.update(status="pending", body=r.request)
            good.append(row)
    with write_session(engine) as session:
        if good:
            session.execute(insert(Request), good)
        if bad:
            session.execute(insert(Request), bad)


def fail_validation(engine: Engine, job_id: str, errors: list[dict]) -> str:
    """Fail a `validating` job whose validation could not complete, dropping the lines an
    attempt inserted; returns its status after (a job being cancelled is left to the cancel)."""
    _delete_lines(engine, job_id)
    return _set_failed(engine, job_id, errors, ("validating",))


def _set_failed(
    engine: Engine, job_id: str, errors: list[dict], statuses=("validating", "cancelling")
) -> str:
    """Fail a job in one of `statuses` with `errors` (OpenAI's batch `errors.data` items);
    returns its status after (another status is left alone: a concurrent cancel)."""
    with write_session(engine) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_(statuses))
            .values(
                status="failed",
                failed_at=time.time(),
                errors=errors,
                request_total=0,
                request_completed=0,
                request_failed=0,
            )
        )
        return session.scalar(select(Job.status).where(Job.id == job_id))


# --------------------------------------------------------------------------------- lines


def pending_lines(
    engine: Engine, job_id: str, after_rid: str, limit: int, upto_rid: str | None = None
) -> list[PendingLine]:
    """Up to `limit` unfinished lines of a job with request id > `after_rid` (and <= `upto_rid`
    when given: the end of a leased line range), in line order."""
    low, high = _id_range(job_id)
    upper = Request.id < high if upto_rid is None else Request.id <= upto_rid
    query = (
        select(Request.id, Request.custom_id, Request.line_no, Request.body)
        .where(Request.id > max(low, after_rid), upper, Request.response.is_(None))
        .order_by(Request.id)
        .limit(limit)
    )
    with read_session(engine) as session:
        return [PendingLine(*row) for row in session.execute(query)]


def write_outcomes(engine: Engine, outcomes: Iterable[Outcome]) -> dict[str, tuple[int, int]]:
    """Write finished lines (only rows still unfinished) and bump the job counters, in one
    transaction. Returns {job_id: (completed added, failed added)}."""
    added: dict[str, list[int]] = {}
    with write_session(engine) as session:
        for o in outcomes:
            failed = results.is_error(o.response)
            values: dict[str, Any] = {
                "response": o.response,
                "status": "failed" if failed else "completed",
            }
            if o.prompt_tokens is not None:
                values["prompt_tokens"] = o.prompt_tokens
            if o.completion_tokens is not None:
                values["completion_tokens"] = o.completion_tokens
            if o.finish_reason is not None:
                values["finish_reason"] = o.finish_reason
            res = session.execute(
                update(Request)
                .where(Request.id == o.rid, Request.response.is_(None))
                .values(**values)
            )
            if res.rowcount:
                slot = added.setdefault(o.job_id, [0, 0])
                slot[1 if failed else 0] += 1
        for job_id, (ok, bad) in added.items():
            session.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(
                    request_completed=Job.request_completed + ok,
                    request_failed=Job.request_failed + bad,
                )
            )
    return {k: (v[0], v[1]) for k, v in added.items()}


def fail_unfinished(engine: Engine, job_id: str, code: str, message: str, status: str) -> int:
    """Give every unfinished line of a job the error `code` (batch_cancelled, batch_expired);
    returns how many. The job's failed counter grows by the same amount (one transaction)."""
    with write_session(engine) as session:
        res = session.execute(
            update(Request)
            .where(Request.job_id == job_id, Request.response.is_(None))
            .values(response=results.error_response(code, message), status=status)
        )
        n = res.rowcount or 0
        if n:
            session.execute(
                update(Job).where(Job.id == job_id).values(request_failed=Job.request_failed + n)
            )
    return n


# --------------------------------------------------------------------------------- finishing


def begin_finalizing(engine: Engine, job_id: str) -> bool:
    """in_progress -> finalizing; True when the job is now finalizing."""
    with write_session(engine) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "in_progress")
            .values(status="finalizing", finalizing_at=time.time())
        )
        return session.scalar(select(Job.status).where(Job.id == job_id)) == "finalizing"


def write_result_files(engine: Engine, job_id: str) -> tuple[str, str | None]:
    """Write the job's output and error files (OpenAI batch output format, line order) from
    SQL, page by page; returns (output_file_id, error_file_id or None when no line failed)."""
    directory = files.files_dir()
    fds = {kind: tempfile.mkstemp(dir=directory, prefix=f".{kind}-") for kind in ("out", "err")}
    written = {"out": 0, "err": 0}
    try:
        with os.fdopen(fds["out"][0], "w") as out, os.fdopen(fds["err"][0], "w") as err:
            low, high = _id_range(job_id)
            last = low
            while True:
                query = (
                    select(Request.id, Request.custom_id, Request.response)
                    .where(Request.id > last, Request.id < high)
                    .order_by(Request.id)
                    .limit(PAGE)
                )
                with read_session(engine) as session:
                    rows = session.execute(query).all()
                for rid, custom_id, response in rows:
                    if response is None:
                        logger.error("job %s: line %s unfinished at finalization", job_id, rid)
                        continue
                    kind = "err" if results.is_error(response) else "out"
                    line = results.output_line(rid, custom_id, response)
                    (err if kind == "err" else out).write(json.dumps(line) + "\n")
                    written[kind] += 1
                if len(rows) < PAGE:
                    break
                last = rows[-1][0]
        output_id = files.put_output_file(engine, job_id, "output", Path(fds["out"][1])).id
        error_id = None
        if written["err"]:
            error_id = files.put_output_file(engine, job_id, "error", Path(fds["err"][1])).id
    finally:
        for _, tmp in fds.values():
            Path(tmp).unlink(missing_ok=True)
    return output_id, error_id


def end_job(
    engine: Engine, job_id: str, status: str, from_statuses: tuple[str, ...], file_ids
) -> str:
    """Set the terminal `status` (and its `*_at`) and the file ids, when the job is still in
    one of `from_statuses`; returns the job's status afterwards."""
    output_id, error_id = file_ids
    with write_session(engine) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_(from_statuses))
            .values(
                status=status,
                output_file_id=output_id,
                error_file_id=error_id,
                **{f"{status}_at": time.time()},
            )
        )
        return session.scalar(select(Job.status).where(Job.id == job_id))
