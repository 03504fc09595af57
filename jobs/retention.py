"""Retention of bulk-job data: the jobs runner's pruning pass (DESIGN.md "Jobs at scale").

Every job keeps three copies of each line: the input file, the line's `requests.body` (and its
`response`), and the output or error file. A pass (`prune`) removes, for data older than the
window (`older_than_s` seconds before `now`):

- files (input, output and error; rows and content on disk) created before the cutoff,
  except a file that a job which has not ended uses (its input, or the output it is writing)
  and an input file of a job that ended after the cutoff;
- the `body` and `response` of the lines of jobs that ended (completed, failed, cancelled,
  expired) before the cutoff: `body` becomes NULL (the mark of a pruned line) and a finished
  line's `response` becomes `PRUNED_RESPONSE`, so the line still reads as finished (`response`
  not NULL, `jobs.store`). The line rows themselves stay, with their token counts and latencies
  (the dashboard's history, `jobs show`), and so does the `jobs` row (status, counts, times);
  its references to deleted files become null.

A job that has not ended is never touched, however old. Each pass writes one
`retention_passes` row with its counts (the dashboard reads them) and the runner logs one line.
The window is the runner's `--retention-days` (default `$LANESERVE_RETENTION_DAYS`, else 30,
the same setting as the recorder's pruning of API request rows and worker snapshots; 0 keeps
everything).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from sqlalchemy import Engine, func, null, select, update

from laneserve.db.models import JOB_TERMINAL_STATUSES, File, Job, Request, RetentionPass
from laneserve.db.session import read_session, write_session
from laneserve.jobs import files

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 3600.0  # seconds between two passes of the runner
# Rows per transaction (each holds SQLite's write lock, so the recorder and gateway wait on it)
FILE_CHUNK = 200  # files deleted
LINE_CHUNK = 2000  # job lines cleared
# What a pruned line's `response` holds (not NULL: the line was finished).
PRUNED_RESPONSE = {"pruned": True}


@dataclass(slots=True)
class PruneCounts:
    """What one pass removed: `files` deleted, their `bytes`, job `lines` whose body and
    response were cleared, and the number of `jobs` those lines belong to."""

    files: int = 0
    bytes: int = 0
    lines: int = 0
    jobs: int = 0

    def describe(self) -> str:
        return (
            f"deleted {self.files} files ({self.bytes / 1e6:.1f} MB), cleared the bodies of "
            f"{self.lines} lines of {self.jobs} ended jobs"
        )


def _ended_at():
    """A job's end time (unix seconds): its terminal `*_at`, else its creation time."""
    return func.coalesce(
        Job.completed_at, Job.failed_at, Job.cancelled_at, Job.expired_at, Job.created_at
    )


def _prune_lines(engine: Engine, cutoff: float, counts: PruneCounts) -> None:
    ended = select(Job.id).where(Job.status.in_(JOB_TERMINAL_STATUSES), _ended_at() < cutoff)
    with read_session(engine) as session:
        job_ids = list(session.scalars(ended))
    for job_id in job_ids:
        cleared = 0
        while True:  # short transactions of LINE_CHUNK lines; ends: each clears what it read
            with write_session(engine) as session:
                ids = list(
                    session.scalars(
                        select(Request.id)
                        .where(Request.job_id == job_id, Request.body.is_not(None))
                        .limit(LINE_CHUNK)
                    )
                )
                if ids:
                    lines = Request.id.in_(ids)
                    session.execute(
                        update(Request)
                        .where(lines, Request.response.is_not(None))
                        .values(body=null(), response=PRUNED_RESPONSE)
                    )
                    session.execute(update(Request).where(lines).values(body=null()))
            cleared += len(ids)
            if len(ids) < LINE_CHUNK:
                break
        if cleared:
            counts.lines += cleared
            counts.jobs += 1


def _prune_files(engine: Engine, cutoff: float, counts: PruneCounts) -> None:
    # inputs of jobs that ended after the cutoff are kept as long as the job's other data
    recent = select(Job.input_file_id).where(Job.input_file_id.is_not(None), _ended_at() >= cutoff)
    old = (
        select(File)
        .where(File.created_at < cutoff, File.id.not_in(recent))
        .order_by(*files.keyset_order(File, False))
    )
    last: tuple[float, str] | None = None  # (created_at, id) of the last file read
    while True:
        query = old if last is None else old.where(files.keyset_after(File, *last, False))
        with write_session(engine) as session:
            rows = list(session.scalars(query.limit(FILE_CHUNK)))
            if not rows:
                return
            last = (rows[-1].created_at, rows[-1].id)
            in_use = files.live_jobs_using(session, [row.id for row in rows])
            doomed = [row for row in rows if row.id not in in_use]
            counts.bytes += files.remove_files(session, doomed)
            counts.files += len(doomed)


def prune(engine: Engine, older_than_s: float, *, now: float | None = None) -> PruneCounts:
    """One pruning pass (module docstring): delete old files and clear the line bodies of jobs
    that ended more than `older_than_s` seconds before `now` (unix seconds, default
    `time.time()`); record it in `retention_passes`. Returns the counts.

    Raises:
        ValueError: `older_than_s` not a positive finite number of seconds.
    """
    if not math.isfinite(older_than_s) or older_than_s <= 0:
        raise ValueError(f"older_than_s={older_than_s} must be a positive number of seconds")
    now = time.time() if now is None else now
    cutoff = now - older_than_s
    counts = PruneCounts()
    _prune_lines(engine, cutoff, counts)
    _prune_files(engine, cutoff, counts)
    with write_session(engine) as session:
        session.add(RetentionPass(at=now, older_than_s=older_than_s, **dataclasses.asdict(counts)))
    return counts
