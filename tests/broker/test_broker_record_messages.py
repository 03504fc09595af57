"""Typed recorder-link messages: RequestRecord and WorkerSnapshot round trips and validation."""

from __future__ import annotations

import math

import msgpack
import pytest

from laneserve.broker import protocol as p

RECORD = {
    "request_id": "chatcmpl-1",
    "lane": "interactive",
    "status": "completed",
    "finish_reason": "length",
    "attempts": 1,
    "arrival_at": 1_700_000_000.25,
    "priority": -2,
    "model": "smollm2",
    "worker_id": "w1",
    "prompt_tokens": 12,
    "cached_tokens": 8,
    "completion_tokens": 5,
    "preemptions": 0,
    "prefill_chunks": 1,
    "spec_draft_tokens": 8,
    "spec_accepted_tokens": 5,
    "spec_num_drafts": 3,
    "queue_ms": 50.0,
    "prefill_ms": 200.0,
    "ttft_ms": 255.5,
    "decode_ms": 200.0,
    "tpot_ms": 50.0,
    "itl_p99_ms": 127.0,
    "e2e_ms": 457.0,
    "job_id": "batch_1",
    "custom_id": "line-1",
    "kind": "generate",
}
SNAPSHOT = {
    "worker_id": "w1",
    "at": 1_700_000_005.0,
    "lanes": ["interactive", "batch"],
    "running": 3,
    "waiting": 1,
    "kv_usage": 0.25,
    "prefix_hit_rate": 0.5,
    "step_ms": 8.0,
    "tokens_per_s": 120.0,
    "preemptions": 2,
    "slo_interactive_ttft_ms": 480.5,
    "slo_interactive_tpot_ms": 38.0,
    "slo_batch_ttft_ms": 4805.0,
    "slo_batch_tpot_ms": 380.0,
    "slo_interactive_attainment": 0.99,
    "slo_batch_attainment": 1.0,
    "step_token_budget": 96,
    "step_batch_tokens": 12,
    "predicted_step_ms": 31.5,
    "measured_step_ms": 33.25,
}


def _batch_frames(records=(), snapshots=(), edge=()) -> list[bytes]:
    payload = {
        "seq": 1,
        "records": list(records),
        "edge_timings": list(edge),
        "snapshots": list(snapshots),
    }
    return [p.VERSION_TAG, b"record_batch", msgpack.packb(payload, use_bin_type=True)]


def test_record_batch_round_trip_keeps_every_field_and_type():
    record = p.RequestRecord(**RECORD)
    snap = p.WorkerSnapshot(**SNAPSHOT)
    edge = p.EdgeTimings(request_id="chatcmpl-1", ttft_ms=260.0, e2e_ms=460.0)
    batch = p.RecordBatch(seq=7, records=[record], edge_timings=[edge], snapshots=[snap])
    got = p.decode(batch.to_frames(), p.BROKER_TO_RECORDER)
    assert got == batch and got.num_items() == 3
    assert type(got.records[0]) is p.RequestRecord and got.records[0].payload() == RECORD | {
        "error_code": None,
        "error_message": None,
    }
    assert type(got.snapshots[0]) is p.WorkerSnapshot and got.snapshots[0].payload() == SNAPSHOT
    assert type(got.edge_timings[0]) is p.EdgeTimings


def test_minimal_and_failed_records_round_trip():
    minimal = {k: RECORD[k] for k in ("request_id", "lane", "status", "finish_reason")}
    minimal |= {"attempts": 0, "arrival_at": 0.0, "finish_reason": "abort", "status": "aborted"}
    failed = RECORD | {
        "status": "failed",
        "finish_reason": "error",
        "error_code": "worker_lost",
        "error_message": "worker lost 3 times",
    }
    for fields in (minimal, failed):
        rec = p.RequestRecord.checked(**fields)
        got = p.decode(p.RecordBatch(seq=1, records=[rec]).to_frames())
        assert got.records == [rec]
    assert p.RequestRecord.checked(**minimal).ttft_ms is None  # unset phases are None


def test_integral_counts_and_int_durations_are_normalized():
    rec = p.RequestRecord.checked(**(RECORD | {"queue_ms": 50, "arrival_at": 1_700_000_000}))
    assert rec.queue_ms == 50.0 and type(rec.queue_ms) is float
    assert type(rec.arrival_at) is float


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("request_id", 5, "expected str"),
        ("request_id", "", "empty request_id"),
        ("request_id", "x" * 257, "longer than"),
        ("lane", "bulk", "not one of"),
        ("status", "done", "not one of"),
        ("finish_reason", "timeout", "not one of"),
        ("attempts", 1.0, "expected int"),
        ("attempts", 1001, "outside"),
        ("arrival_at", "now", "expected number"),
        ("prompt_tokens", -1, "outside"),
        ("prompt_tokens", True, "expected int"),
        ("completion_tokens", "5", "expected int"),
        ("ttft_ms", float("nan"), "outside"),
        ("ttft_ms", math.inf, "outside"),
        ("ttft_ms", -1.0, "outside"),
        ("e2e_ms", "12", "expected number"),
        ("model", ["smollm2"], "expected str"),
        ("custom_id", "c" * 4097, "longer than"),
        ("error_code", "boom", "not one of"),
        ("error_code", "engine_error", "error_code is set exactly when status is failed"),
        ("error_message", "m" * (p.MAX_TEXT_CHARS + 1), "longer than"),
        ("body", {"x": 1}, "unknown fields"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else type(v).__name__,
)
def test_record_validation_errors(field, value, why):
    fields = RECORD | {field: value}
    with pytest.raises(p.ProtocolError, match=why):
        p.RequestRecord.checked(**fields)
    with pytest.raises(p.ProtocolError, match=why):  # the same check on the recorder's side
        p.decode(_batch_frames(records=[fields]), p.BROKER_TO_RECORDER)


def test_failed_record_needs_an_error_code():
    with pytest.raises(p.ProtocolError, match="error_code"):
        p.RequestRecord.checked(**(RECORD | {"status": "failed", "finish_reason": "error"}))


@pytest.mark.parametrize("missing", ["request_id", "lane", "status", "finish_reason", "attempts"])
def test_record_missing_required_field(missing):
    fields = {k: v for k, v in RECORD.items() if k != missing}
    with pytest.raises(p.ProtocolError, match=f"missing field '{missing}'"):
        p.RequestRecord.checked(**fields)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("worker_id", None, "expected str"),
        ("at", "now", "expected number"),
        ("lanes", "interactive,batch", "expected list"),
        ("lanes", ["interactive", "batch", "batch"], "more than 2"),
        ("lanes", ["gpu"], "not one of"),
        ("running", 2.5, "expected int"),
        ("kv_usage", 1.5, "outside"),
        ("prefix_hit_rate", -0.1, "outside"),
        ("step_ms", float("nan"), "outside"),
        ("tokens_per_s", "fast", "expected number"),
        ("preemptions", -3, "outside"),
        ("gpu_util", 0.5, "unknown fields"),
    ],
)
def test_snapshot_validation_errors(field, value, why):
    fields = SNAPSHOT | {field: value}
    with pytest.raises(p.ProtocolError, match=why):
        p.WorkerSnapshot.checked(**fields)
    with pytest.raises(p.ProtocolError, match=why):
        p.decode(_batch_frames(snapshots=[fields]), p.BROKER_TO_RECORDER)


@pytest.mark.parametrize(
    "payload",
    [
        {"seq": 1, "records": [["chatcmpl-1", "interactive"]]},  # not a map
        {"seq": 1, "records": {"request_id": "x"}},  # not a list
        {"seq": 1, "snapshots": [None]},
        {"seq": 1, "edge_timings": [{"request_id": "x", "ttft_ms": "fast"}]},
        {"seq": 1, "records": [RECORD] * (p.MAX_RECORDS + 1)},  # too many in one batch
        {"seq": -1},
        {"seq": 1, "records": [], "rows": []},
    ],
)
def test_malformed_batches_are_protocol_errors(payload):
    frames = [p.VERSION_TAG, b"record_batch", msgpack.packb(payload, use_bin_type=True)]
    with pytest.raises(p.ProtocolError):
        p.decode(frames, p.BROKER_TO_RECORDER)


def test_records_are_not_top_level_messages_on_the_link():
    frames = p.RequestRecord(**RECORD).to_frames()
    with pytest.raises(p.ProtocolError, match="unexpected message kind"):
        p.decode(frames, p.BROKER_TO_RECORDER)
