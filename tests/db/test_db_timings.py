"""DESIGN per-phase latency fields from a scripted timeline, computed and stored."""

from __future__ import annotations

import numpy as np
import pytest

from db.models import Request
from db.recorder import write_batch
from db.session import read_session
from db.timings import TimelineError, compute_timings, percentile

# Monotonic seconds: arrival 100.0, scheduled after 50 ms of queueing, prefill of 200 ms,
# then 5 tokens with gaps 20, 30, 20, 130 ms, final sent 10 ms after the last token.
ARRIVAL = 100.0
FIRST_SCHEDULED = 100.05
TOKENS = [100.25, 100.27, 100.30, 100.32, 100.45]
FINISHED = 100.46

EXPECTED = {
    "queue_ms": 50.0,
    "prefill_ms": 200.0,
    "ttft_ms": 250.0,
    "decode_ms": 200.0,
    "tpot_ms": 50.0,  # 200 ms / (5 - 1)
    "itl_p99_ms": 127.0,  # gaps [20, 20, 30, 130], rank 3 * 0.99 = 2.97: 30 + 0.97 * 100
    "e2e_ms": 460.0,
}


def test_scripted_timeline_exact_values():
    assert compute_timings(ARRIVAL, FIRST_SCHEDULED, TOKENS, FINISHED) == EXPECTED


def test_edge_times_override_engine_times():
    got = compute_timings(
        ARRIVAL, FIRST_SCHEDULED, TOKENS, FINISHED, first_content_sent=100.26, final_sent=100.5
    )
    assert got["ttft_ms"] == 260.0 and got["e2e_ms"] == 500.0


def test_single_token_has_no_tpot_or_itl():
    got = compute_timings(ARRIVAL, FIRST_SCHEDULED, TOKENS[:1], 100.26)
    assert got["tpot_ms"] is None and got["itl_p99_ms"] is None
    assert got["decode_ms"] == 0.0 and got["ttft_ms"] == 250.0


def test_never_scheduled_request():
    got = compute_timings(ARRIVAL, None, [], 100.5)
    assert got == {**dict.fromkeys(EXPECTED), "e2e_ms": 500.0}


@pytest.mark.parametrize(
    "args",
    [
        (100.0, 99.0, [], 101.0),  # scheduled before arrival
        (100.0, 100.1, [100.3, 100.2], 101.0),  # tokens out of order
        (100.0, 100.1, [100.3], 100.2),  # finished before the last token
        (100.0, None, [100.3], 101.0),  # tokens but never scheduled
        (float("nan"), 100.1, [], 101.0),
    ],
)
def test_bad_timelines_raise(args):
    with pytest.raises(TimelineError):
        compute_timings(*args)


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=37).tolist()
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), abs=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_recorded_timeline_has_the_exact_values(engine):
    record = {
        "id": "chatcmpl-timeline",
        "lane": "interactive",
        "completion_tokens": len(TOKENS),
        **compute_timings(ARRIVAL, FIRST_SCHEDULED, TOKENS, FINISHED),
    }
    assert write_batch(engine, [record], []).records_written == 1
    with read_session(engine) as s:
        row = s.get(Request, "chatcmpl-timeline")
        assert {k: getattr(row, k) for k in EXPECTED} == EXPECTED
