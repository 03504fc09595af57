"""jobs.leases: line-range and control leases, takeover of a lapsed lease (SQLite + PostgreSQL)."""

from __future__ import annotations

import threading
import time

import pytest

from laneserve.db.models import Request
from laneserve.db.session import read_session
from laneserve.jobs import leases, results, store
from tests.harness import chat_line, submit, write_jsonl

PER_PART = 2  # lines per range here: 5 lines make ranges 1-2, 3-4, 5


def _job(engine, home, n=5):
    job = submit(
        engine, write_jsonl(home / "in.jsonl", [chat_line(f"c{i}", "q") for i in range(n)])
    )
    assert store.validate_job(engine, job.id, None, "m") == "in_progress"
    return job


def _claim(engine, job, owner, lease_s=30.0, exclude=frozenset()):
    return leases.claim_range(engine, job.id, owner, lease_s, exclude, PER_PART)


def _finish_lines(engine, job, lease):
    lines = store.pending_lines(engine, job.id, "", 10, lease.last_rid)
    outcomes = [
        store.Outcome(job.id, pl.rid, results.error_response("engine_error", "x"))
        for pl in lines
        if pl.rid >= lease.first_rid
    ]
    store.write_outcomes(engine, outcomes)


def test_runners_claim_disjoint_ranges_and_finish_them(any_engine, laneserve_home):
    engine = any_engine
    job = _job(engine, laneserve_home)
    a1 = _claim(engine, job, "a")
    b1 = _claim(engine, job, "b")
    assert (a1.part, a1.first_line, a1.last_line) == (1, 1, 2)
    assert (b1.part, b1.first_line, b1.last_line) == (2, 3, 4)
    a2 = _claim(engine, job, "a", exclude={1})
    assert (a2.part, a2.last_line) == (3, 6)  # the last range is short: line 5 only
    assert _claim(engine, job, "b", exclude={2}) is None  # every range is held
    # Lines of range 1 are done: the range is done, never claimed again.
    _finish_lines(engine, job, a1)
    assert leases.finish_range(engine, a1, "a")
    # Range 3 still has an open line: released, not done, so the next claim reads it again.
    assert not leases.finish_range(engine, a2, "a")
    assert _claim(engine, job, "b", exclude={2}).part == 3
    rows = {r.part: (r.owner, r.done) for r in leases.leases_of(engine, job.id)}
    assert rows == {1: (None, True), 2: ("b", False), 3: ("b", False)}


def test_lapsed_lease_is_taken_over_and_its_holder_told(any_engine, laneserve_home):
    engine = any_engine
    job = _job(engine, laneserve_home)
    a = _claim(engine, job, "a", lease_s=0.2)
    assert leases.renew(engine, "a", [a.key], 0.2) == set()  # renewed in time: still a's
    assert _claim(engine, job, "b", exclude={2, 3}) is None
    time.sleep(0.3)  # a stops renewing (killed): the lease lapses
    b = _claim(engine, job, "b", exclude={2, 3})
    assert (b.part, b.previous_owner) == (1, "a")
    assert leases.renew(engine, "a", [a.key], 30.0) == {a.key}  # a learns it lost the range
    (row, *_) = leases.leases_of(engine, job.id)
    assert (row.owner, row.takeovers) == ("b", 1)
    # A runner restarted with the same id reclaims its own lease without waiting.
    again = _claim(engine, job, "b")
    assert again.part == 1 and again.previous_owner is None


def test_control_lease_is_exclusive_until_released_or_lapsed(any_engine, laneserve_home):
    engine = any_engine
    job = _job(engine, laneserve_home)
    # a's lease lasts 2 s: long enough that b's claim lands inside it on a loaded machine
    # (0.2 s lapsed before b's claim once, in a full test run on 2 busy cores)
    assert leases.claim_control(engine, job.id, "a", 2.0)
    assert not leases.claim_control(engine, job.id, "b", 30.0)
    assert leases.claim_control(engine, job.id, "a", 2.0)  # renewing one's own
    time.sleep(2.5)
    assert leases.claim_control(engine, job.id, "b", 30.0)  # lapsed: b takes over
    leases.release(engine, "b", [(job.id, leases.CONTROL)])
    assert leases.claim_control(engine, job.id, "a", 30.0)


def test_concurrent_claims_never_share_a_range(any_engine, laneserve_home):
    engine = any_engine
    job = _job(engine, laneserve_home, n=40)  # 20 ranges
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def claim_all(owner):
        while (lease := _claim(engine, job, owner, exclude=set(got[owner]))) is not None:
            got[owner].append(lease.part)

    threads = [threading.Thread(target=claim_all, args=(o,)) for o in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    parts = [p for owned in got.values() for p in owned]
    assert sorted(parts) == list(range(1, 21))  # each range claimed once, by one runner


@pytest.mark.parametrize("n", [1, 3])
def test_range_bounds_cover_every_line_once(any_engine, laneserve_home, n):
    engine = any_engine
    job = _job(engine, laneserve_home, n=n)
    seen = []
    while (lease := _claim(engine, job, "a", exclude=set(seen))) is not None:
        seen.append(lease.part)
        lines = store.pending_lines(engine, job.id, store.request_id(job.id, lease.first_line - 1),
                                    10, lease.last_rid)  # fmt: skip
        assert all(lease.first_line <= pl.line_no <= lease.last_line for pl in lines)
    with read_session(engine) as s:
        total = s.query(Request).filter(Request.job_id == job.id).count()
    assert len(seen) == -(-total // PER_PART)
