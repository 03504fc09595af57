"""Wire protocol: round trips, strict validation, size limits, no pickle anywhere."""

from __future__ import annotations

import pathlib
import random
import re

import msgpack
import pytest

from laneserve.broker import protocol as p

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _frames(kind: str, payload) -> list[bytes]:
    return [p.VERSION_TAG, kind.encode(), msgpack.packb(payload, use_bin_type=True)]


def test_round_trip_every_kind() -> None:
    msgs = [
        p.Submit(
            request_id="r1", lane="interactive", prompt="hi", sampling_params={"max_tokens": 4}
        ),
        p.Submit(request_id="r2", lane="batch", messages=[{"role": "user", "content": "x"}]),
        p.Submit(request_id="r3", lane="batch", prompt_token_ids=[1, 2, 3], stream=False),
        p.Abort(request_id="r1"),
        p.StatusRequest(request_id="s"),
        p.Hello(client_id="c"),
        p.Delta(request_id="r1", text="é😀", token_ids=[7], logprobs=[{"7": -0.5}]),
        p.Final(request_id="r1", finish_reason="stop", usage={"prompt_tokens": 3}),
        p.Error(request_id="r1", code="overloaded", message="full", retryable=True),
        p.Heartbeat(epoch="e1"),
        p.StatusReply(workers=[{"pid": 1}], queues={"interactive": 0}),
        p.Ready(worker_id="w", pid=12, lanes=["batch"], capacity=8, model="m"),
        p.WorkerHeartbeat(worker_id="w", stats={"running": 1, "kv_usage": 0.5}),
        p.StepOutputs(
            worker_id="w",
            outputs=[
                p.StepOutput("r1", "a", [1]),
                p.StepOutput("r2", "", [2], True, "length", None, {"queue_ms": 1.5}),
            ],
            step_ms=3.0,
        ),
        p.WorkerError(worker_id="w", code="engine_error", message="boom", request_id="r1"),
        p.WorkRequest(request_id="r1", lane="batch", prompt="x", attempt=2),
        p.Disconnect(reason="bye"),
        p.RecordBatch(
            seq=3,
            records=[
                p.RequestRecord(
                    request_id="r1",
                    lane="batch",
                    status="completed",
                    finish_reason="stop",
                    attempts=1,
                    arrival_at=1.7e9,
                )
            ],
            edge_timings=[p.EdgeTimings(request_id="r1", ttft_ms=5.0)],
            snapshots=[p.WorkerSnapshot(worker_id="w", at=1.7e9, lanes=["batch"])],
        ),
        p.RecordAck(seq=3),
    ]
    for msg in msgs:
        frames = msg.to_frames()
        assert frames[0] == p.VERSION_TAG
        assert p.decode(frames) == msg
        assert type(msg).from_frames(frames) == msg


def test_step_outputs_carry_the_engines_outputs_as_they_are() -> None:
    """The wire item is the engine's own `EngineOutput` (no copy in the worker), labelled
    logprobs included, and it decodes back as one."""
    from laneserve.contracts.engine_io import EngineOutput, EngineRequest, label_logprobs

    assert p.StepOutput is EngineOutput
    lps = label_logprobs([{"token_id": 5, "logprob": -0.5, "top": [[5, -0.5]]}], str)
    out = EngineOutput("r1", " a", [5], True, "stop", lps, {"queue_ms": 1.0})
    (back,) = p.decode(p.StepOutputs(worker_id="w", outputs=[out]).to_frames()).outputs
    assert type(back) is EngineOutput and back == out
    assert back.logprobs[0]["token"] == "5" and back.logprobs[0]["top_tokens"] == ["5"]
    work = p.WorkRequest(request_id="r1", lane="batch", prompt_token_ids=[1, 2], priority=3)
    assert work.engine_request(arrival_time=2.0) == EngineRequest("r1", [1, 2], {}, "batch", 3, 2.0)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [p.VERSION_TAG],
        [p.VERSION_TAG, b"submit"],
        [p.VERSION_TAG, b"abort", msgpack.packb({"request_id": "a"}), b"extra"],
        [b"LS0", b"abort", msgpack.packb({"request_id": "a"})],
        [p.VERSION_TAG, b"no_such_kind", msgpack.packb({})],
        [p.VERSION_TAG, b"abort", b"\xc1\xc1"],
        [p.VERSION_TAG, b"abort", msgpack.packb({"request_id": "a"}) + b"\x00"],
        [p.VERSION_TAG, b"abort", msgpack.packb(["a"])],
        [p.VERSION_TAG, b"abort", msgpack.packb({"request_id": 5})],
        [p.VERSION_TAG, b"abort", msgpack.packb({"request_id": "a", "x": 1})],
        [p.VERSION_TAG, b"abort", msgpack.packb({})],
        [p.VERSION_TAG, b"abort", msgpack.packb({"request_id": "a" * 10_000})],
        [p.VERSION_TAG, b"abort", msgpack.packb({"request_id": b"bytes"}, use_bin_type=True)],
        [p.VERSION_TAG, b"abort", msgpack.packb({1: "a"})],
        [p.VERSION_TAG, b"abort", msgpack.packb(msgpack.ExtType(1, b"x"))],
    ],
)
def test_malformed_frames_raise_protocol_error(frames) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(frames)


@pytest.mark.parametrize(
    "payload",
    [
        {"request_id": "a", "lane": "fast", "prompt": "x"},
        {"request_id": "a", "lane": "batch"},
        {"request_id": "a", "lane": "batch", "prompt": "x", "messages": [{"role": "u"}]},
        {"request_id": "", "lane": "batch", "prompt": "x"},
        {"request_id": "a", "lane": "batch", "prompt_token_ids": [1, -2]},
        {"request_id": "a", "lane": "batch", "prompt_token_ids": [1, 2.0]},
        {"request_id": "a", "lane": "batch", "prompt": "x", "sampling_params": {"evil": 1}},
        {"request_id": "a", "lane": "batch", "prompt": "x", "priority": True},
        {"request_id": "a", "lane": "batch", "prompt": "x", "stream": 1},
        {"request_id": "a", "lane": "batch", "prompt": "x", "arrival_time": float("nan")},
        {"request_id": "a", "lane": "batch", "messages": [{"content": "no role"}]},
        {
            "request_id": "a",
            "lane": "batch",
            "prompt": "x",
            "sampling_params": {"stop": [[[[[[[[[[]]]]]]]]]]},
        },
    ],
)
def test_submit_validation(payload) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(_frames("submit", payload), p.CLIENT_TO_BROKER)


def test_direction_is_enforced() -> None:
    frames = p.Delta(request_id="a", text="x").to_frames()
    with pytest.raises(p.ProtocolError, match="unexpected message kind"):
        p.decode(frames, p.CLIENT_TO_BROKER)
    assert p.decode(frames, p.BROKER_TO_CLIENT).text == "x"


def test_step_output_validation() -> None:
    bad_items = [
        ["r", "t", [1], True, None, None, None, None],  # finished without a reason
        ["r", "t", [1], False, None, None, None],  # wrong arity
        ["r", "t", [1], False, "weird", None, None, None],
        {"request_id": "r"},
    ]
    for item in bad_items:
        with pytest.raises(p.ProtocolError):
            p.decode(_frames("step_outputs", {"worker_id": "w", "outputs": [item]}))


def test_oversize_message_refused() -> None:
    big = "x" * (p.MAX_TEXT_CHARS + 1)
    with pytest.raises(p.ProtocolError):
        p.Submit(request_id="a", lane="batch", prompt="x" * 10).from_payload(
            {"request_id": "a", "lane": "batch", "prompt": big}
        )


def test_fuzz_random_bytes_only_protocol_errors() -> None:
    rng = random.Random(1234)
    kinds = [b"submit", b"abort", b"step_outputs", b"ready", b"record_batch", b"x"]
    for _ in range(3000):
        n = rng.randint(0, 4)
        frames = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40))) for _ in range(n)]
        if n == 3 and rng.random() < 0.7:
            frames[0] = p.VERSION_TAG
            frames[1] = rng.choice(kinds)
        try:
            p.decode(frames)
        except p.ProtocolError:
            pass


def test_no_pickle_in_project_packages() -> None:
    pattern = re.compile(
        r"^\s*(import|from)\s+(pickle|_pickle|cPickle|dill|cloudpickle)\b"
        r"|\b(pickle|cloudpickle|dill)\.(loads?|dumps?|Unpickler|Pickler)\b"
        r"|\b(recv_pyobj|send_pyobj|recv_serialized|send_serialized)\b"
    )
    offenders = []
    for pkg in ("broker", "gpu_worker", "jobs", "db", "laneserve"):
        for path in (ROOT / pkg).rglob("*.py"):
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == [], "pickle on the wire is forbidden:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "payload",
    [
        {"request_id": "a", "text": 5, "token_ids": [], "logprobs": None},
        {"request_id": "a", "text": "x", "token_ids": [-1], "logprobs": None},
        {"request_id": "a", "text": "x", "token_ids": [1], "logprobs": None, "extra": 1},
        {"request_id": 1, "text": "x", "token_ids": [1], "logprobs": None},
        {"request_id": "a", "text": "x", "token_ids": [True], "logprobs": None},
        {"request_id": "a", "text": "x", "token_ids": [1], "logprobs": "no"},
        {"text": "x", "token_ids": [1], "logprobs": None, "request_id2": "a"},
    ],
)
def test_delta_fast_path_still_strict(payload) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(_frames("delta", payload), p.BROKER_TO_CLIENT)
