"""Synthetic traffic for the dashboard tests: record and snapshot dicts in the recorder's shape.

Requests and worker snapshots are written through the recorder's own write path
(`db.recorder.write_batch`, the function the recorder process commits each `RecordBatch` with),
as the record dicts of docs/interfaces.md "Records to SQL"; job rows, which the jobs runner owns,
through `db.session.write_session` and `db.models.Job`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np
import sqlalchemy as sa

from laneserve.db.models import Job
from laneserve.db.recorder import write_batch
from laneserve.db.session import write_session

# A fixed "now" (2023-11-14T22:00:00Z, a whole hour) so tests are deterministic; windows end here.
NOW = 1_699_999_200.0
MODEL = "smollm2-135m"


@dataclass
class Profile:
    """Per-phase latency distribution (ms) of synthetic requests of one lane."""

    queue: float = 5.0
    prefill: float = 80.0
    tpot: float = 20.0
    tokens: int = 64
    prompt_tokens: int = 300
    preemptions: float = 0.0  # Poisson mean
    cached: float = 0.0  # share of each prompt served from the prefix cache
    chunks: int = 1  # prefill chunks per request
    itl_ratio: float = 1.5  # each request's ITL P99 / its TPOT


def make_records(
    rng: np.random.Generator,
    n: int,
    start: float,
    end: float,
    lane: str = "interactive",
    profile: Profile | None = None,
    model: str = MODEL,
    worker_id: str = "w0",
) -> list[dict]:
    """`n` finished-request record dicts (docs/interfaces.md "Records to SQL") finishing in
    [start, end), with phase timings consistent with DESIGN.md's definitions."""
    p = profile or Profile()
    out = []
    for _ in range(n):
        queue = float(rng.exponential(p.queue))
        prefill = float(rng.gamma(4.0, p.prefill / 4.0))
        completion = int(rng.integers(1, 2 * p.tokens))
        tpot = float(rng.gamma(9.0, p.tpot / 9.0)) if completion >= 2 else None
        decode = tpot * (completion - 1) if tpot is not None else 0.0
        transport = float(rng.uniform(0.2, 2.0))
        ttft = queue + prefill + transport
        e2e = ttft + decode + transport
        finished = float(rng.uniform(start, end))
        arrival = finished - e2e / 1000.0
        prompt = int(rng.integers(p.prompt_tokens // 2, p.prompt_tokens * 3 // 2))
        out.append(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "job_id": None,
                "custom_id": None,
                "lane": lane,
                "priority": 0,
                "model": model,
                "worker_id": worker_id,
                "status": "completed",
                "finish_reason": "length" if rng.random() < 0.5 else "stop",
                "error": None,
                "attempts": 1,
                "prompt_tokens": prompt,
                "cached_tokens": int(prompt * p.cached),
                "completion_tokens": completion,
                "preemptions": int(rng.poisson(p.preemptions)),
                "prefill_chunks": p.chunks,
                "arrival_at": arrival,
                "first_scheduled_at": arrival + queue / 1000.0,
                "first_token_at": arrival + ttft / 1000.0,
                "finished_at": finished,
                "queue_ms": queue,
                "prefill_ms": prefill,
                "ttft_ms": ttft,
                "decode_ms": decode,
                "tpot_ms": tpot,
                "itl_p99_ms": tpot * p.itl_ratio if tpot is not None else None,
                "e2e_ms": e2e,
            }
        )
    return out


def make_snapshots(
    worker_id: str,
    lanes: str,
    start: float,
    end: float,
    every_s: float = 5.0,
    running: int = 8,
    waiting: int = 0,
    kv_usage: float = 0.5,
    preemptions: list[int] | None = None,
) -> list[dict]:
    """Worker snapshot dicts every `every_s` seconds in [start, end); `preemptions` is the
    cumulative counter per snapshot (default 0)."""
    ts = np.arange(start, end, every_s)
    pre = preemptions or [0] * len(ts)
    return [
        {
            "worker_id": worker_id,
            "lanes": lanes,
            "running": running,
            "waiting": waiting,
            "kv_usage": kv_usage,
            "prefix_hit_rate": 0.6,
            "step_ms": 25.0,
            "tokens_per_s": 400.0,
            "preemptions": pre[i],
            "at": float(t),
        }
        for i, t in enumerate(ts)
    ]


def store(engine, records=(), snapshots=(), jobs=()) -> None:
    """Write job rows, then records and snapshots through the recorder; all must be written."""
    if jobs:
        with write_session(engine) as s:
            s.execute(sa.insert(Job), list(jobs))
    for i in range(0, max(len(records), len(snapshots)), 5000):  # recorder-sized batches
        result = write_batch(engine, records[i : i + 5000], snapshots[i : i + 5000])
        assert result.records_failed == result.snapshots_failed == 0, result.errors
