"""Request state: statuses, token views, timestamps and the engine metrics dict."""

from __future__ import annotations

import numpy as np
import pytest

from laneserve.gpu_worker.request import Lane, Request, RequestStatus


def test_status_finish_reasons():
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    for st in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED):
        assert not st.is_finished and st.finish_reason is None
    assert Lane("interactive") is Lane.INTERACTIVE and Lane.BATCH == "batch"
    assert Lane.INTERACTIVE.rank < Lane.BATCH.rank


def test_token_views_and_slices():
    r = Request("r", [1, 2, 3], lane="interactive")
    assert r.lane is Lane.INTERACTIVE and r.status is RequestStatus.WAITING
    r.append_output_token_ids([4, 5], now=10.0)
    r.append_output_token_ids(6, now=10.5)
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 3, 6)
    for a in range(7):
        for b in range(a, 7):
            assert r.token_ids_slice(a, b) == r.all_token_ids[a:b]
    assert r.first_token_time == 10.0 and r.last_token_time == 10.5
    assert r.token_gaps_ms == pytest.approx([0.0, 500.0])


def test_metrics_dict():
    r = Request("r", [1] * 7, arrival_time=100.0)
    r.first_scheduled_time = 100.25
    for i, t in enumerate([100.5, 100.6, 100.8, 101.5]):
        r.append_output_token_ids(i, now=t)
    r.num_cached_tokens = 4
    m = r.metrics()
    assert m["queue_ms"] == pytest.approx(250.0)
    assert m["prefill_ms"] == pytest.approx(250.0)
    assert m["decode_ms"] == pytest.approx(1000.0)
    assert m["tpot_ms"] == pytest.approx(1000.0 / 3)
    assert m["itl_p99_ms"] == pytest.approx(np.percentile([100.0, 200.0, 700.0], 99))
    assert m["first_token_delay_ms"] == pytest.approx(500.0)
    assert (m["prompt_tokens"], m["cached_tokens"], m["completion_tokens"]) == (7, 4, 4)
    unscheduled = Request("u", [1]).metrics()
    assert unscheduled["queue_ms"] is None and unscheduled["tpot_ms"] is None
    assert unscheduled["cached_tokens"] == 0 and unscheduled["itl_p99_ms"] is None
