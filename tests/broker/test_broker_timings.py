"""The broker's per-phase timings: DESIGN's fields composed from per-hop intervals.

Hand-worked timeline (the same as tests/contracts): the edge held the request 5 ms; the broker
received it at 10.000 s (its clock), dispatched it at 10.025 s, saw the first content token at
10.250 s and finished at 10.452 s; the engine scheduled it 20 ms and produced its first token
220 ms after accepting it.
"""

from __future__ import annotations

import pytest

from laneserve.broker import protocol as p
from laneserve.broker.requests import RequestState, timings, usage

METRICS = {
    "first_scheduled_delay_ms": 20.0,
    "first_token_delay_ms": 220.0,
    "prefill_ms": 200.0,
    "decode_ms": 200.0,
    "tpot_ms": 50.0,
    "itl_p99_ms": 127.0,
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "cached_tokens": 8,
}


def _req(stream: bool = True, dispatched: float = 10.025) -> RequestState:
    submit = p.Submit(request_id="r1", lane="interactive", prompt="hi", stream=stream, edge_ms=5.0)
    return RequestState(
        submit=submit,
        client=b"c",
        received=10.0,
        arrival_at=1_700_000_000.0,
        dispatched=dispatched,
        first_token=10.25,
    )


def test_streamed_request_timings():
    got = timings(_req(), METRICS, now=10.452)
    assert got == pytest.approx(
        {
            "queue_ms": 50.0,  # 5 (edge) + 25 (broker) + 20 (engine)
            "prefill_ms": 200.0,
            "ttft_ms": 255.0,  # 5 + (10.250 - 10.000) at the broker
            "decode_ms": 200.0,
            "tpot_ms": 50.0,
            "itl_p99_ms": 127.0,
            "e2e_ms": 457.0,  # 5 + (10.452 - 10.000)
            "broker_wait_ms": 30.0,
        }
    )


def test_non_streamed_ttft_is_the_wait_plus_the_engine_delay():
    got = timings(_req(stream=False), METRICS, now=10.452)
    assert got["ttft_ms"] == pytest.approx(250.0)  # 30 ms to dispatch + 220 ms in the engine


def test_never_dispatched_request_has_only_e2e():
    got = timings(_req(dispatched=0.0), {}, now=10.1)
    assert got["e2e_ms"] == pytest.approx(105.0)
    assert got["broker_wait_ms"] is None and got["queue_ms"] is None
    assert got["ttft_ms"] == pytest.approx(255.0)  # a streamed token was seen all the same
    assert timings(_req(stream=False, dispatched=0.0), {}, now=10.1)["ttft_ms"] is None


def test_usage_falls_back_to_the_tokens_the_broker_counted():
    req = _req()
    req.num_tokens = 3
    assert usage(req, {}) == {"prompt_tokens": None, "completion_tokens": 3, "cached_tokens": None}
    assert usage(req, METRICS)["completion_tokens"] == 5


def test_work_request_carries_every_prompt_field_of_the_submit():
    submit = p.Submit(
        request_id="r9",
        lane="batch",
        messages=[{"role": "user", "content": "x"}],
        sampling_params={"max_tokens": 3, "temperature": 0.5},
        priority=-4,
        model="smollm2",
        stream=False,
        job_id="batch_1",
        custom_id="line-2",
        task="embed",
    )
    work = p.WorkRequest.of(submit, attempt=2)
    shared = {k: v for k, v in submit.payload().items() if k in work.payload()}
    assert work.payload() == shared | {"attempt": 2, "output_token_ids": None}
    assert set(shared) == {
        "request_id", "lane", "sampling_params", "prompt", "messages", "prompt_token_ids",
        "priority", "model", "attempt", "task",
    }  # fmt: skip
    # the worker's front end templates and tokenizes a prompt sent as messages; the engine gets ids
    seen = []

    def encode(prompt=None, messages=None):
        seen.append((prompt, messages))
        return [5, 6]

    engine_request = work.engine_request(0.0, encode)
    assert engine_request.task == "embed" and engine_request.prompt_token_ids == [5, 6]
    assert seen == [(None, [{"role": "user", "content": "x"}])]
    with pytest.raises(ValueError, match="prompt encoder"):
        work.engine_request(0.0)
    assert p.decode(work.to_frames(), p.BROKER_TO_WORKER) == work
    # a resumed attempt: the tokens it had and the params it goes on with reach the engine
    resumed = p.WorkRequest.of(submit, 3, [7, 8], {"max_tokens": 3})
    assert p.decode(resumed.to_frames(), p.BROKER_TO_WORKER) == resumed
    again = resumed.engine_request(0.0, encode)
    assert again.output_token_ids == [7, 8] and again.sampling_params == {"max_tokens": 3}
