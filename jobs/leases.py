"""Expiring leases that let several jobs runners share one database (DESIGN.md "Jobs at scale").

A job is split into *parts*, one `job_leases` row each (db.models.JobLease):

    part 0           the job's control: validation, cancel, expiry, finalization
    part k >= 1      lines [(k-1)*R + 1, k*R]   (1-based line numbers, R = lines_per_part)

A runner claims a part by writing its id into `owner` and `now + lease_s` into `expires_at`,
renews its parts every `lease_s / 3` while it works on them, and releases them when it stops. A
part is free when it has no owner or its lease has lapsed: a killed runner's parts are taken over
by whoever asks next once `lease_s` has passed (counted in `takeovers`). On PostgreSQL the claim
reads candidate rows with `SELECT ... FOR UPDATE SKIP LOCKED`, so concurrent runners never wait
on each other's rows and never claim the same one; on SQLite the write transaction
(`BEGIN IMMEDIATE`) is the single writer, which serializes claims. The final `UPDATE` repeats the
free-row condition, so a claim is exact on both.

A lease only decides who *runs* a line; exactly-once *results* come from `jobs.store.write_outcomes`
(it fills only a NULL `response`), so a runner that lost its lease while a result was on its way
cannot write a second one. Line-range rows are created on the first claim of an `in_progress` job
(insert-or-ignore, so two runners creating them at once is harmless).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from sqlalchemy import Engine, and_, func, or_, select, update
from sqlalchemy.orm import Session

from laneserve.db.models import JobLease, Request
from laneserve.db.session import read_session, write_session
from laneserve.jobs.store import request_id

logger = logging.getLogger(__name__)

CONTROL = 0  # the part that stands for the job itself
LINES_PER_PART = 128  # lines per range lease: a few page reads, seconds of work per runner
DEFAULT_LEASE_S = 15.0  # a killed runner's lines wait this long before another takes them


@dataclass(frozen=True, slots=True)
class Lease:
    """A part held by this runner: lines `first_line..last_line` (inclusive) of `job_id`."""

    job_id: str
    part: int
    first_line: int
    last_line: int
    previous_owner: str | None = None  # set when this claim took over a lapsed lease

    @property
    def key(self) -> tuple[str, int]:
        return self.job_id, self.part

    @property
    def first_rid(self) -> str:
        return request_id(self.job_id, self.first_line)

    @property
    def last_rid(self) -> str:
        return request_id(self.job_id, self.last_line)


def part_of(line_no: int, lines_per_part: int = LINES_PER_PART) -> int:
    """The range part that holds 1-based line `line_no`."""
    return (line_no - 1) // lines_per_part + 1


def _free(owner: str, now: float):
    """Rows this runner may claim: unowned, lapsed, or its own (a restart with the same id)."""
    return or_(JobLease.owner.is_(None), JobLease.expires_at < now, JobLease.owner == owner)


def _insert_ignore(session: Session, rows: list[dict]) -> None:
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    session.execute(insert(JobLease).on_conflict_do_nothing(), rows)


def _ensure_parts(session: Session, job_id: str, lines_per_part: int) -> None:
    has_parts = session.scalar(
        select(func.count()).where(JobLease.job_id == job_id, JobLease.part > CONTROL)
    )
    if has_parts:
        return
    n = session.scalar(select(func.max(Request.line_no)).where(Request.job_id == job_id)) or 0
    rows = [
        {"job_id": job_id, "part": k, "lines_per_part": lines_per_part}
        for k in range(1, math.ceil(n / lines_per_part) + 1)
    ]
    if rows:
        _insert_ignore(session, rows)


def _take(session: Session, row: JobLease, owner: str, lease_s: float, now: float) -> str | None:
    """Write the claim on a locked, free `row`; returns the lapsed owner it took over, if any."""
    previous = row.owner if row.owner not in (None, owner) else None
    took = session.execute(
        update(JobLease)
        .where(JobLease.job_id == row.job_id, JobLease.part == row.part, _free(owner, now))
        .values(
            owner=owner,
            expires_at=now + lease_s,
            takeovers=JobLease.takeovers + (1 if previous else 0),
        )
    ).rowcount
    assert took == 1, f"lease {row.job_id}/{row.part} was locked but not free"
    if previous:
        logger.warning(
            "%s: took over part %d of job %s from %s (lease lapsed)",
            owner,
            row.part,
            row.job_id,
            previous,
        )
    return previous


def claim_range(
    engine: Engine,
    job_id: str,
    owner: str,
    lease_s: float,
    exclude: frozenset[int] | set[int] = frozenset(),
    lines_per_part: int = LINES_PER_PART,
) -> Lease | None:
    """Claim the lowest free, unfinished line range of `job_id` for `lease_s` seconds (parts in
    `exclude`, which this runner holds already, are skipped); None when there is none."""
    now = time.time()
    with write_session(engine) as session:
        _ensure_parts(session, job_id, lines_per_part)
        conditions = [JobLease.job_id == job_id, JobLease.part > CONTROL, JobLease.done.is_(False)]
        if exclude:
            conditions.append(JobLease.part.not_in(sorted(exclude)))
        row = session.scalars(
            select(JobLease)
            .where(and_(*conditions), _free(owner, now))
            .order_by(JobLease.part)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if row is None:
            return None
        previous = _take(session, row, owner, lease_s, now)
        size = row.lines_per_part or lines_per_part
        first = (row.part - 1) * size + 1
        return Lease(job_id, row.part, first, first + size - 1, previous)


def claim_control(engine: Engine, job_id: str, owner: str, lease_s: float) -> bool:
    """Claim (or renew) the control of `job_id`: True when this runner holds it now."""
    now = time.time()
    with write_session(engine) as session:
        _insert_ignore(session, [{"job_id": job_id, "part": CONTROL}])
        row = session.scalars(
            select(JobLease)
            .where(JobLease.job_id == job_id, JobLease.part == CONTROL, _free(owner, now))
            .with_for_update(skip_locked=True)
        ).first()
        if row is None:
            return False
        _take(session, row, owner, lease_s, now)
        return True


def renew(
    engine: Engine, owner: str, keys: list[tuple[str, int]], lease_s: float
) -> set[tuple[str, int]]:
    """Extend this runner's leases `keys` ((job_id, part) pairs) to `now + lease_s`; returns the
    keys it no longer holds (another runner took them over after they lapsed)."""
    lost = set()
    now = time.time()
    with write_session(engine) as session:
        for job_id, part in keys:
            res = session.execute(
                update(JobLease)
                .where(JobLease.job_id == job_id, JobLease.part == part, JobLease.owner == owner)
                .values(expires_at=now + lease_s)
            )
            if not res.rowcount:
                lost.add((job_id, part))
    return lost


def finish_range(engine: Engine, lease: Lease, owner: str) -> bool:
    """Mark `lease`'s range done and release it when every line in it has a result (True);
    otherwise release it so the next claim (this runner's too) reads it again (False)."""
    with write_session(engine) as session:
        open_lines = session.scalar(
            select(func.count()).where(
                Request.id >= lease.first_rid,
                Request.id <= lease.last_rid,
                Request.response.is_(None),
            )
        )
        session.execute(
            update(JobLease)
            .where(JobLease.job_id == lease.job_id, JobLease.part == lease.part)
            .where(JobLease.owner == owner)
            .values(done=open_lines == 0, owner=None, expires_at=None)
        )
    return open_lines == 0


def release(engine: Engine, owner: str, keys: list[tuple[str, int]]) -> None:
    """Give up leases `keys` now (a clean stop): other runners may claim them at once."""
    with write_session(engine) as session:
        for job_id, part in keys:
            session.execute(
                update(JobLease)
                .where(JobLease.job_id == job_id, JobLease.part == part, JobLease.owner == owner)
                .values(owner=None, expires_at=None)
            )


def leases_of(engine: Engine, job_id: str) -> list[JobLease]:
    """Every lease row of a job, by part (for status pages and tests)."""
    with read_session(engine) as session:
        return list(
            session.scalars(
                select(JobLease).where(JobLease.job_id == job_id).order_by(JobLease.part)
            )
        )
