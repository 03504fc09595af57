"""Several jobs runners on one PostgreSQL (issue 22, item 1): leases share the lines, a SIGKILLed
runner's lines are taken over once its lease lapses, and every `custom_id` is written once.

Real processes on ipc:// sockets: broker, two synthetic workers (batch lane), two jobs runners
with a 2 s lease on a PostgreSQL database of the test's own.
"""

from __future__ import annotations

import time

import pytest

from laneserve.jobs import leases
from tests.harness import (
    Stack,
    chat_line,
    check_exactly_once,
    job_state,
    report,
    submit_job,
    wait_for,
    wait_job_done,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LEASE_S = 2.0


def _owners(engine, job_id) -> set[str | None]:
    return {row.owner for row in leases.leases_of(engine, job_id) if row.part > leases.CONTROL}


def test_two_runners_share_a_job_and_survive_one_killed(own_pg_url, laneserve_home) -> None:
    from laneserve.db import migrate
    from laneserve.db.session import make_engine

    migrate.upgrade(own_pg_url)
    engine = make_engine(own_pg_url)
    stack = Stack.for_jobs(laneserve_home, own_pg_url)
    try:
        stack.start_broker()
        for name in ("w1", "w2"):
            stack.start_worker(name, "--synthetic-step-ms", "10", lanes="batch")
        lease = ("--lease-timeout", str(LEASE_S), "--max-in-flight", "16")
        for name in ("runner-a", "runner-b"):
            stack.start_jobs_runner(*lease, name=name)
        stack.wait_workers({"w1", "w2"})
        ids = [f"r{i:04d}" for i in range(600)]  # 5 line ranges of 128
        job = submit_job(
            engine, stack.tmp, [chat_line(c, f"t {c}", 20, temperature=None) for c in ids]
        )
        wait_for(lambda: {"runner-a", "runner-b"} <= _owners(engine, job.id), 60,
                 "both runners holding a line range")  # fmt: skip
        wait_for(lambda: job_state(engine, job.id).request_counts["completed"] >= 20, 180,
                 "job progress")  # fmt: skip
        t_kill = time.monotonic()
        stack.kill("runner-a")
        done_at_kill = job_state(engine, job.id).request_counts["completed"]

        def taken_over() -> bool:
            return any(r.takeovers for r in leases.leases_of(engine, job.id))

        wait_for(taken_over, LEASE_S + 30, "runner-b to take over runner-a's lines")
        takeover_s = time.monotonic() - t_kill
        job = wait_job_done(engine, job.id, 180, stack)
        assert job.status == "completed", job.status
        out, err = check_exactly_once(engine, job, ids)
        assert len(out) == len(ids) and err == [], err[:3]
        assert all(r.done for r in leases.leases_of(engine, job.id) if r.part > leases.CONTROL)
        assert takeover_s >= LEASE_S * 0.5  # not before the dead runner's lease could lapse
        report(
            "22.1 two jobs runners on PostgreSQL, one SIGKILLed",
            lines=len(ids),
            lease_s=LEASE_S,
            completed_at_kill=done_at_kill,
            takeover_after_kill_s=round(takeover_s, 2),
            duplicates=0,
            lines_lost=0,
        )
    finally:
        stack.stop()
        engine.dispose()
