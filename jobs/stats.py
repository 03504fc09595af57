"""A bulk job's figures from SQL: tokens, throughput, latency percentiles of its lines, ETA, files.

Served as `GET /v1/batches/{id}/stats` (laneserve/api/inspection.py) for `laneserve jobs show`
and the progress bar of `jobs watch` / `submit --wait`, which the OpenAI batch object cannot
feed. One call reads the `jobs` row, one aggregate and two columns of the job's `requests` rows
and its `files` rows: cost O(lines of the job).

Throughput and ETA use the job's own clock: from `in_progress_at` (set by the jobs runner) to its
end (`completed_at` / `failed_at` / `cancelled_at` / `expired_at`) or to now while it runs. Those
are wall-clock seconds, used here as a time window (DESIGN.md "Storage" conventions), never as a
request's latency; the latency figures come from the per-request `*_ms` columns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, Row, func, select
from sqlalchemy.orm import Session

from laneserve.contracts.latency import percentile
from laneserve.db.models import File, Job, Request
from laneserve.db.session import read_session
from laneserve.jobs.errors import NotFoundError

PERCENTILES = (50, 90, 99)
LATENCY_FIELDS = ("ttft_ms", "e2e_ms")
# The error codes of the lines a job's cancellation or expiry ended (jobs.store.fail_unfinished
# stores them as the line's `response`, which only the runner writes: the line's `status` is
# also written by the recorder, whichever comes last, so it cannot tell).
ENDED_BY_JOB_CODES = ("batch_cancelled", "batch_expired")


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One of the job's files: id, filename, size in bytes."""

    id: str
    filename: str
    bytes: int


@dataclass(frozen=True, slots=True)
class BatchStats:
    """Figures of one job (all durations ms, rates per second, times unix seconds).

    `finished_lines`: lines with a result (output or error) recorded in `requests`;
    `cancelled_lines`: of those, lines the job's cancellation or expiry ended (error lines
    `batch_cancelled` / `batch_expired`, counted in `failed` as DESIGN.md says), whatever they
    had computed before it: they are left out of the token sums, rates and latencies, since
    their output is thrown away;
    `prompt_tokens` / `completion_tokens` / `cached_tokens`: sums over the other finished lines;
    `elapsed_s`: seconds since the job started running (to its end once ended), None before;
    `output_tokens_per_s` and `lines_per_s` over `elapsed_s`; `eta_s`: seconds left
    (:func:`smoothed_eta`; None when ended or no line is done yet); `latency_ms`: for `ttft_ms` and
    `e2e_ms`, `{"count", "p50", "p90", "p99"}` over the job's lines (None values when no line
    has the figure); `files`: `input` / `output` / `errors` (None when absent).
    """

    id: str
    status: str
    request_counts: dict[str, int]
    finished_lines: int
    cancelled_lines: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    started_at: float | None
    ended_at: float | None
    elapsed_s: float | None
    output_tokens_per_s: float | None
    lines_per_s: float | None
    eta_s: float | None
    latency_ms: dict[str, dict[str, float | int | None]]
    files: dict[str, FileInfo | None]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the stats route (`"object": "batch.stats"`)."""
        return {"object": "batch.stats", **asdict(self)}


def usage_of(stats: BatchStats) -> dict[str, Any]:
    """OpenAI's batch `usage` object from a job's figures: the tokens of its lines so far (the
    lines its cancellation or expiry cut left out, as in `BatchStats`)."""
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.cached_tokens},
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


def _ended_at(job: Job) -> float | None:
    for value in (job.completed_at, job.failed_at, job.cancelled_at, job.expired_at):
        if value is not None:
            return value
    return None


def latency_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """`{"count", "p50", "p90", "p99"}` of `values` (ms); the percentiles None when empty."""
    out: dict[str, float | int | None] = {"count": len(values)}
    for q in PERCENTILES:
        value = percentile(values, q)  # the one percentile rule (None when empty)
        out[f"p{q}"] = None if value is None else round(value, 3)
    return out


def _rate(amount: float, elapsed_s: float | None) -> float | None:
    if elapsed_s is None or elapsed_s <= 0:
        return None
    return amount / elapsed_s


# The lines that have a result (output or error), and of those the ones the job itself did not
# end (error code not in ENDED_BY_JOB_CODES).
_FINISHED = Request.response.is_not(None) | Request.error.is_not(None)
_ERROR_CODE = func.coalesce(Request.response["error"]["code"].as_string(), "")
_RAN = _ERROR_CODE.not_in(ENDED_BY_JOB_CODES)


ETA_LINES = 32  # the exponential average's span, in completed lines (alpha = 2 / (span + 1))
_ETA_WINDOW = 4 * ETA_LINES  # the latest completions read per poll


def smoothed_eta(
    finished_at: Sequence[float], start: float, done: int, total: int, now: float
) -> float | None:
    """Seconds left: the remaining lines times an exponential average of the time between
    completed lines (seeded with the job's mean until the window's first completion, then
    `ETA_LINES` lines' span), less the time since the last completion. Between completions it
    only falls, so a slow tail (few lines in flight) does not make it rise as the job ends;
    0 means the next completion is overdue. `finished_at`: the latest completion times
    (unix seconds, ascending), at most all `done` of them."""
    if not finished_at or done <= 0 or total <= 0:
        return None
    first = finished_at[0]
    before = done - len(finished_at)  # completions older than the window
    interval = (first - start) / (before + 1) if before else first - start
    alpha = 2.0 / (ETA_LINES + 1)
    for prev, cur in zip(finished_at, finished_at[1:], strict=False):
        interval = alpha * (cur - prev) + (1 - alpha) * interval
    return max(0.0, max(0, total - done) * max(interval, 0.0) - (now - finished_at[-1]))


def _latest_finished(session: Session, batch_id: str) -> list[float]:
    """The latest `_ETA_WINDOW` completion times of the job's lines, ascending."""
    rows = session.execute(
        select(Request.finished_at)
        .where(Request.job_id == batch_id, Request.finished_at.is_not(None))
        .order_by(Request.finished_at.desc())
        .limit(_ETA_WINDOW)
    )
    return sorted(v for (v,) in rows)


def _may_have_ended_lines(job: Job, now: float) -> bool:
    """Whether the job's cancellation or expiry may have ended some of its lines: only then
    are the lines' responses read for their error code (a JSON field each), which is most of a
    progress poll's cost over thousands of lines."""
    expiring = job.expires_at is not None and now >= job.expires_at
    return expiring or job.status in ("cancelling", "cancelled", "expired")


def _line_sums(session: Session, job: Job, now: float) -> tuple[Row, int | None]:
    """(count, prompt, completion, cached token sums) of the finished lines the job ran to
    their end, and the count of finished lines its cancellation or expiry ended."""
    batch_id = job.id
    ended = _may_have_ended_lines(job, now)
    sums = session.execute(
        select(
            func.count(Request.id),
            func.sum(Request.prompt_tokens),
            func.sum(Request.completion_tokens),
            func.sum(Request.cached_tokens),
        ).where(Request.job_id == batch_id, _FINISHED, *((_RAN,) if ended else ()))
    ).one()
    if not ended:
        return sums, 0
    cancelled = session.scalar(
        select(func.count(Request.id)).where(
            Request.job_id == batch_id, _FINISHED, _ERROR_CODE.in_(ENDED_BY_JOB_CODES)
        )
    )
    return sums, cancelled


def _latency_values(
    session: Session, batch_id: str, names: Sequence[str]
) -> dict[str, list[float]]:
    """For each `*_ms` column in `names`, its non-null values over the lines the job ran."""
    return {
        name: [
            v
            for (v,) in session.execute(
                select(getattr(Request, name)).where(
                    Request.job_id == batch_id, _RAN, getattr(Request, name).is_not(None)
                )
            )
        ]
        for name in names
    }


def _job_files(session: Session, job: Job) -> dict[str, FileInfo | None]:
    """The job's `input` / `output` / `errors` files (None when it has none, or the row is gone)."""
    file_ids = {
        "input": job.input_file_id,
        "output": job.output_file_id,
        "errors": job.error_file_id,
    }
    rows = {f.id: f for f in session.scalars(select(File).where(File.id.in_(
        [fid for fid in file_ids.values() if fid]
    )))}  # fmt: skip
    return {
        kind: FileInfo(rows[fid].id, rows[fid].filename, int(rows[fid].bytes or 0))
        if fid in rows
        else None
        for kind, fid in file_ids.items()
    }


def batch_stats(
    engine: Engine, batch_id: str, now: float | None = None, *, latency: bool = True
) -> BatchStats:
    """The figures of batch `batch_id` (`now`: unix seconds, default the current time); without
    `latency` the percentiles are left out (counts 0, values None), which saves reading a column
    per line on each poll of a progress bar.

    Raises:
        NotFoundError: no such batch.
    """
    with read_session(engine) as session:
        job = session.get(Job, batch_id)
        if job is None:
            raise NotFoundError(f"no batch {batch_id!r}")
        sums, cancelled = _line_sums(session, job, now or time.time())
        values = _latency_values(session, batch_id, LATENCY_FIELDS if latency else ())
        files = _job_files(session, job)
        latest = _latest_finished(session, batch_id) if _ended_at(job) is None else []
    counts = job.request_counts
    ended = _ended_at(job)
    start = job.in_progress_at
    elapsed = None if start is None else max(0.0, (ended or (now or time.time())) - start)
    done = counts["completed"] + counts["failed"]
    lines_per_s = _rate(done, elapsed)
    eta = None
    if ended is None and start is not None:
        eta = smoothed_eta(latest, start, done, counts["total"], now or time.time())
    return BatchStats(
        id=job.id,
        status=job.status,
        request_counts=counts,
        finished_lines=int(sums[0] or 0) + int(cancelled or 0),
        cancelled_lines=int(cancelled or 0),
        prompt_tokens=int(sums[1] or 0),
        completion_tokens=int(sums[2] or 0),
        cached_tokens=int(sums[3] or 0),
        started_at=start,
        ended_at=ended,
        elapsed_s=elapsed,
        output_tokens_per_s=_rate(int(sums[2] or 0), elapsed),
        lines_per_s=lines_per_s,
        eta_s=eta,
        latency_ms={name: latency_summary(values.get(name, [])) for name in LATENCY_FIELDS},
        files=files,
    )
