"""Response encoding: -inf logprobs as valid JSON, logprob objects, SSE framing, error shape."""

from __future__ import annotations

import json
import math

import pytest

from laneserve.api.errors import ApiError, error_response
from laneserve.contracts.openai import ServedModel
from laneserve.contracts.openai import responses as fmt

INFO = ServedModel().token_text  # no tokenizer: tokens render as "token_id:N"


def test_clamp_logprob() -> None:
    assert fmt.clamp_logprob(-math.inf) == -9999.0
    assert fmt.clamp_logprob(math.nan) == -9999.0
    assert fmt.clamp_logprob(None) == -9999.0
    assert fmt.clamp_logprob(-1e9) == -9999.0
    assert fmt.clamp_logprob(-0.25) == -0.25
    assert fmt.clamp_logprob(math.inf) == 0.0


def test_logprobs_with_inf_are_valid_json() -> None:
    raw = [{"token_id": 5, "logprob": -math.inf, "top": [[5, -math.inf], [7, -0.5]]}]
    chat = fmt.chat_logprobs(raw, INFO)
    text = fmt.dumps(chat)
    assert "Infinity" not in text and "NaN" not in text
    entry = json.loads(text)["content"][0]
    assert entry["token"] == "token_id:5" and entry["logprob"] == -9999.0
    assert entry["bytes"] == list(b"token_id:5")
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-9999.0, -0.5]
    legacy = fmt.completion_logprobs(raw * 2, INFO, offset=3)
    assert legacy["tokens"] == ["token_id:5", "token_id:5"]
    assert legacy["token_logprobs"] == [-9999.0, -9999.0]
    assert legacy["top_logprobs"][0] == {"token_id:5": -9999.0, "token_id:7": -0.5}
    assert legacy["text_offset"] == [3, 3 + len("token_id:5")]
    json.loads(fmt.dumps(legacy))


def test_logprob_texts_are_the_engines() -> None:
    """Entries carrying the engine's texts (`contracts.engine_io.label_logprobs`) are formatted
    without decoding a token at the edge."""
    from laneserve.contracts.engine_io import label_logprobs

    raw = label_logprobs([{"token_id": 5, "logprob": -0.1, "top": [(5, -0.1), (7, -2.5)]}],
                         {5: " Paris", 7: "é"}.__getitem__)  # fmt: skip

    def refuse(token_id: int) -> str:
        raise AssertionError(f"the edge decoded token {token_id}")

    entry = fmt.chat_logprobs(raw, refuse)["content"][0]
    assert entry["token"] == " Paris" and entry["bytes"] == list(b" Paris")
    assert [(t["token"], t["bytes"]) for t in entry["top_logprobs"]] == [
        (" Paris", list(b" Paris")),
        ("é", [0xC3, 0xA9]),
    ]
    legacy = fmt.completion_logprobs(raw, refuse, offset=2)
    assert legacy["tokens"] == [" Paris"] and legacy["text_offset"] == [2]
    assert legacy["top_logprobs"] == [{" Paris": -0.1, "é": -2.5}]


def test_dumps_refuses_non_finite() -> None:
    with pytest.raises(ValueError):
        fmt.dumps({"x": math.inf})


def test_sse_framing() -> None:
    assert fmt.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    # text that str.splitlines (httpx's iter_lines) breaks at stays inside one event line
    text = "a\u2028b\x85c\u2029d\x1ce\x0bf\rg"
    lines = fmt.sse({"t": text}).decode().splitlines()
    assert lines[1:] == [""] and json.loads(lines[0][6:]) == {"t": text}
    assert fmt.SSE_DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("code", "status", "etype"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("prompt_too_long", 400, "invalid_request_error"),
        ("unauthorized", 401, "authentication_error"),
        ("not_found", 404, "invalid_request_error"),
        ("payload_too_large", 413, "invalid_request_error"),
        ("overloaded", 429, "rate_limit_error"),
        ("no_worker", 503, "service_unavailable_error"),
        ("worker_lost", 503, "service_unavailable_error"),
        ("deadline_exceeded", 504, "timeout_error"),
    ],
)
def test_error_shape_and_status(code, status, etype) -> None:
    resp = error_response(code, "why", "field")
    assert resp.status_code == status
    assert json.loads(resp.body) == {
        "error": {"message": "why", "type": etype, "param": "field", "code": code}
    }
    assert ("retry-after" in resp.headers) == (status in (429, 503))
    assert ApiError(code, "why").status == status
