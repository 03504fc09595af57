"""contracts.latency: each DESIGN per-phase field from a hand-worked timeline, and the percentile rule.

The timeline (three clocks, as in production: the edge's, the broker's and the engine's, with
unrelated offsets; only intervals on one clock are ever subtracted):

- edge clock: arrival at 100.000 s; first content token leaves the edge at 100.260 s; final
  sent at 100.460 s. The edge held the request 5 ms before sending it to the broker.
- broker clock: received at 7.000 s, dispatched at 7.025 s (25 ms wait), first content token
  seen at 7.250 s, final seen at 7.452 s.
- engine clock: accepted at 500.000 s, first scheduled at 500.020 s, output tokens at 500.220,
  500.240, 500.270, 500.290 and 500.420 s (gaps 20, 30, 20, 130 ms).

By DESIGN's definitions:
  queue   = 5 + 25 (to the engine) + 20 (engine wait)        = 50 ms
  prefill = 500.220 - 500.020                                  = 200 ms
  ttft    = 100.260 - 100.000 at the edge                      = 260 ms
            (at the broker: 5 + (7.250 - 7.000)               = 255 ms, without the last hop)
  decode  = 500.420 - 500.220                                  = 200 ms
  tpot    = 200 / (5 - 1)                                      = 50 ms
  itl_p99 = sorted gaps [20, 20, 30, 130], rank 3 * 0.99 = 2.97: 30 + 0.97 * 100 = 127 ms
  e2e     = 100.460 - 100.000 at the edge                      = 460 ms
            (at the broker: 5 + (7.452 - 7.000)               = 457 ms)
"""

from __future__ import annotations

import numpy as np
import pytest

from laneserve.contracts import latency as lat

EDGE_ARRIVAL, EDGE_FIRST_SENT, EDGE_FINAL_SENT = 100.0, 100.26, 100.46
EDGE_HOLD_MS = 5.0
BROKER_RECEIVED, BROKER_DISPATCHED, BROKER_FIRST, BROKER_FINAL = 7.0, 7.025, 7.25, 7.452
ENGINE_ACCEPTED, ENGINE_SCHEDULED = 500.0, 500.02
ENGINE_TOKENS = [500.22, 500.24, 500.27, 500.29, 500.42]

EXACT = pytest.approx  # float readings: equal to well under a microsecond


def _gaps_ms(times: list[float]) -> list[float]:
    return [lat.interval_ms(a, b) for a, b in zip(times, times[1:], strict=False)]


def test_queue_ms_sums_the_hops_up_to_the_first_schedule():
    to_engine = EDGE_HOLD_MS + lat.interval_ms(BROKER_RECEIVED, BROKER_DISPATCHED)
    engine_wait = lat.interval_ms(ENGINE_ACCEPTED, ENGINE_SCHEDULED)
    assert lat.queue_ms(to_engine, engine_wait) == EXACT(50.0)
    assert lat.queue_ms(0.0, engine_wait) == EXACT(20.0)  # the engine is the edge (offline LLM)
    assert lat.queue_ms(to_engine, None) is None  # never scheduled
    assert lat.queue_ms(None, engine_wait) is None  # never dispatched


def test_prefill_decode_and_tpot_from_engine_readings():
    first, last = ENGINE_TOKENS[0], ENGINE_TOKENS[-1]
    assert lat.prefill_ms(ENGINE_SCHEDULED, first) == EXACT(200.0)
    decode = lat.decode_ms(first, last)
    assert decode == EXACT(200.0)
    assert lat.tpot_ms(decode, len(ENGINE_TOKENS)) == EXACT(50.0)
    assert lat.prefill_ms(ENGINE_SCHEDULED, None) is None  # aborted before the first token
    assert lat.decode_ms(None, None) is None


@pytest.mark.parametrize("completion_tokens", [None, 0, 1])
def test_tpot_is_null_below_two_tokens(completion_tokens):
    assert lat.tpot_ms(0.0, completion_tokens) is None
    assert lat.tpot_ms(None, 5) is None


def test_one_token_answer_has_zero_decode_and_no_gaps():
    only = ENGINE_TOKENS[:1]
    assert lat.decode_ms(only[0], only[-1]) == 0.0
    assert lat.tpot_ms(0.0, 1) is None
    assert lat.itl_p99_ms(_gaps_ms(only)) is None


def test_itl_p99_of_the_token_gaps():
    gaps = _gaps_ms(ENGINE_TOKENS)
    assert gaps == [EXACT(20.0), EXACT(30.0), EXACT(20.0), EXACT(130.0)]
    assert lat.itl_p99_ms(gaps) == EXACT(127.0)
    assert lat.itl_p99_ms([0.0, 0.0, 40.0]) == EXACT(39.2)  # one step's tokens: 0 ms gaps


def test_ttft_and_e2e_at_the_edge_and_at_the_broker():
    assert lat.ttft_ms(0.0, lat.interval_ms(EDGE_ARRIVAL, EDGE_FIRST_SENT)) == EXACT(260.0)
    assert lat.e2e_ms(0.0, lat.interval_ms(EDGE_ARRIVAL, EDGE_FINAL_SENT)) == EXACT(460.0)
    broker_first = lat.interval_ms(BROKER_RECEIVED, BROKER_FIRST)
    assert lat.ttft_ms(EDGE_HOLD_MS, broker_first) == EXACT(255.0)
    assert lat.e2e_ms(EDGE_HOLD_MS, lat.interval_ms(BROKER_RECEIVED, BROKER_FINAL)) == EXACT(457.0)
    # Without a streamed token at the broker: up to dispatch, then the engine's own delay.
    to_engine = EDGE_HOLD_MS + lat.interval_ms(BROKER_RECEIVED, BROKER_DISPATCHED)
    engine_first = lat.interval_ms(ENGINE_ACCEPTED, ENGINE_TOKENS[0])
    assert lat.ttft_ms(to_engine, engine_first) == EXACT(250.0)
    assert lat.ttft_ms(to_engine, None) is None  # no token produced


def test_ttft_includes_queue_and_prefill():
    """DESIGN: ttft = queue + prefill + transport, so it is never below queue + prefill."""
    to_engine = EDGE_HOLD_MS + lat.interval_ms(BROKER_RECEIVED, BROKER_DISPATCHED)
    queue = lat.queue_ms(to_engine, lat.interval_ms(ENGINE_ACCEPTED, ENGINE_SCHEDULED))
    prefill = lat.prefill_ms(ENGINE_SCHEDULED, ENGINE_TOKENS[0])
    ttft = lat.ttft_ms(0.0, lat.interval_ms(EDGE_ARRIVAL, EDGE_FIRST_SENT))
    assert queue + prefill == EXACT(250.0) and ttft - (queue + prefill) == EXACT(10.0)


def test_interval_ms_needs_both_readings():
    assert lat.interval_ms(1.0, 1.5) == 500.0
    assert lat.interval_ms(None, 1.5) is None and lat.interval_ms(1.0, None) is None


def test_percentile_hand_worked_values():
    assert lat.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert lat.percentile([20.0, 20.0, 30.0, 130.0], 99) == EXACT(127.0)
    assert lat.percentile([130.0, 20.0, 30.0, 20.0], 99) == EXACT(127.0)  # order does not matter
    assert lat.percentile([7.0], 99) == 7.0
    assert lat.percentile([3.0, 1.0], 0) == 1.0 and lat.percentile([3.0, 1.0], 100) == 3.0
    assert lat.percentile([], 50) is None


def test_percentile_matches_numpy_default():
    rng = np.random.default_rng(0)
    for n in (2, 3, 37, 1000):
        values = rng.exponential(size=n).tolist()
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            want = np.percentile(values, q)
            assert lat.percentile(values, q) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("q", [-1.0, 100.5, float("nan")])
def test_percentile_rejects_q_outside_0_100(q):
    with pytest.raises(ValueError, match="outside"):
        lat.percentile([1.0, 2.0], q)


def test_timing_fields_are_designs_order():
    assert lat.TIMING_FIELDS == (
        "queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "itl_p99_ms", "e2e_ms",
    )  # fmt: skip
