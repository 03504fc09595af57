"""Recorded traffic for every diagnosis rule: requests, worker snapshots and jobs as the recorder
and the jobs runner write them, each case with the one (lane, cause) list it must produce.

`CASES[name](now)` returns a `Case`; `store_case(engine, case)` writes it through the recorder's
write path. Every case's recent part is the last 5 minutes before `now`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from dashboard_data import Profile, make_records, make_snapshots, store

from laneserve.dashboard.diagnose import Cause

HOUR = 3600.0
RECENT = 300.0


@dataclass
class Case:
    records: list[dict]
    snapshots: list[dict]
    expected: list[tuple[str, Cause]]
    jobs: list[dict] = field(default_factory=list)


def _job(now: float, **kw) -> dict:
    job = {"id": "batch_sum", "status": "in_progress", "endpoint": "/v1/chat/completions",
           "model": "smollm2-135m", "created_at": now - 900, "in_progress_at": now - 890,
           "expires_at": now + 86000, "request_total": 400, "request_completed": 40,
           "request_failed": 0}  # fmt: skip
    return job | kw


def healthy(now: float) -> Case:
    rng = np.random.default_rng(10)
    recs = make_records(rng, 200, now - HOUR, now - 1, "interactive")
    recs += make_records(rng, 100, now - HOUR, now - 1, "batch", Profile(prefill=300, tpot=30))
    snaps = make_snapshots("w0", "interactive,batch", now - RECENT, now, kv_usage=0.4)
    return Case(recs, snaps, [])


def batch_behind_interactive(now: float) -> Case:
    """The issue's case: batch TTFT and TPOT up against the earlier window, KV 5 %, no
    preemption, batch queue time ~ its whole TTFT: queueing (by design), not KV."""
    rng = np.random.default_rng(11)
    recs = make_records(rng, 150, now - HOUR, now - 1, "interactive")
    recs += make_records(rng, 60, now - HOUR, now - RECENT - 5, "batch", Profile(tpot=30))
    recs += make_records(rng, 40, now - RECENT + 5, now - 1, "batch",
                         Profile(queue=20000, tpot=60))  # fmt: skip
    snaps = make_snapshots("w0", "interactive,batch", now - RECENT, now, kv_usage=0.05099)
    return Case(recs, snaps, [("batch", Cause.BATCH_BEHIND_INTERACTIVE)], [_job(now)])


def batch_first_minutes(now: float) -> Case:
    """The first minutes of a run: no baseline yet, batch TTFT P99 far above its limit."""
    rng = np.random.default_rng(12)
    recs = make_records(rng, 30, now - 200, now - 1, "interactive")
    recs += make_records(rng, 40, now - 200, now - 1, "batch", Profile(queue=20000))
    snaps = make_snapshots("w0", "interactive,batch", now - 200, now, kv_usage=0.05)
    return Case(recs, snaps, [("batch", Cause.BATCH_BEHIND_INTERACTIVE)], [_job(now)])


def interactive_queueing(now: float) -> Case:
    rng = np.random.default_rng(13)
    recs = make_records(rng, 200, now - HOUR, now - RECENT - 5, "interactive")
    recs += make_records(rng, 50, now - RECENT + 5, now - 1, "interactive", Profile(queue=3000))
    snaps = make_snapshots("w0", "interactive", now - RECENT, now, every_s=10, kv_usage=0.7)
    snaps[-1]["waiting"] = 30
    return Case(recs, snaps, [("interactive", Cause.QUEUEING)])


def _long_prefills(now: float, cached: float, seed: int) -> list[dict]:
    """Long prompts (2,000 tokens) whose prefill makes TTFT P99 ~ 3 s, `cached` share cached."""
    profile = Profile(prefill=1500, prompt_tokens=2000, cached=cached)
    rng = np.random.default_rng(seed)
    return make_records(rng, 60, now - RECENT + 5, now - 1, "interactive", profile)


def prefix_misses(now: float) -> Case:
    snaps = make_snapshots("w0", "interactive", now - RECENT, now, kv_usage=0.6)
    return Case(_long_prefills(now, 0.0, 14), snaps, [("interactive", Cause.PREFIX_MISSES)])


def big_prefills(now: float) -> Case:
    snaps = make_snapshots("w0", "interactive", now - RECENT, now, kv_usage=0.6)
    return Case(_long_prefills(now, 0.6, 15), snaps, [("interactive", Cause.BIG_PREFILLS)])


def kv_full(now: float) -> Case:
    rng = np.random.default_rng(16)
    recs = make_records(rng, 60, now - RECENT + 5, now - 1, "interactive",
                        Profile(tpot=150, preemptions=2.0))  # fmt: skip
    snaps = make_snapshots("w0", "interactive", now - RECENT, now, kv_usage=0.96,
                           preemptions=list(range(0, 600, 10)))  # fmt: skip
    return Case(recs, snaps, [("interactive", Cause.KV_FULL)])


def chunks_steal_decode(now: float) -> Case:
    rng = np.random.default_rng(17)
    recs = make_records(rng, 60, now - RECENT + 5, now - 1, "interactive", Profile(itl_ratio=6))
    recs += make_records(rng, 20, now - RECENT + 5, now - 1, "batch",
                         Profile(prompt_tokens=2000, chunks=4, prefill=300))  # fmt: skip
    snaps = make_snapshots("w0", "interactive,batch", now - RECENT, now, kv_usage=0.6)
    return Case(recs, snaps, [("interactive", Cause.CHUNKS_STEAL_DECODE)])


def long_prompt_timeouts(now: float) -> Case:
    rng = np.random.default_rng(18)
    recs = make_records(rng, 100, now - RECENT + 5, now - 1, "batch")
    slow = make_records(rng, 4, now - RECENT + 5, now - 1, "batch", Profile(prompt_tokens=4000))
    for r in slow:
        r.update(status="failed", finish_reason=None, error="deadline_exceeded: 30 s")
    return Case(recs + slow, [], [("batch", Cause.LONG_PROMPTS)])


def throughput_flat(now: float) -> Case:
    rng = np.random.default_rng(19)
    recs = make_records(rng, 300, now - HOUR, now - 1, "interactive")
    snaps = make_snapshots("w0", "interactive", now - RECENT, now, waiting=20, kv_usage=0.2)
    return Case(recs, snaps, [("interactive", Cause.BATCH_CAP)])


CASES: dict[str, Callable[[float], Case]] = {
    f.__name__: f
    for f in (
        healthy, batch_behind_interactive, batch_first_minutes, interactive_queueing,
        prefix_misses, big_prefills, kv_full, chunks_steal_decode, long_prompt_timeouts,
        throughput_flat,
    )
}  # fmt: skip


def store_case(engine, case: Case) -> None:
    store(engine, records=case.records, snapshots=case.snapshots, jobs=case.jobs)
