"""A bulk-job line and an API request with the same body: the same validation result (the same
error code and message) and the same wire sampling params.

The API side is the real gateway app (in this process, so the sampling params it hands to its
real broker client can be read) in front of the real broker and synthetic worker of
``synth_stack``; the batch side is the real jobs validator with the same served model, and the
runner's ``submit_kwargs`` for what it would send.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from laneserve.contracts.engine_io import EngineRequest
from laneserve.jobs.results import choice_requests
from laneserve.jobs.tokens import load_served_model
from laneserve.jobs.validate import Validator
from tests.harness import Stack, write_jsonl

pytestmark = pytest.mark.slow

MODEL = "smollm2"
CHAT = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_TURN = [
    {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "done"},
]  # fmt: skip
PROMPT_KEYS = ("sampling_params", "prompt", "messages", "prompt_token_ids")
TEXT = "/v1/completions"
MSG = [{"role": "user", "content": "Say hi."}]
BASE = {
    CHAT: {"model": MODEL, "messages": MSG, "max_tokens": 4},
    TEXT: {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4},
}
DROP = object()  # remove the key from the base body

# (endpoint, changes to the base body): every supported field, valid and not, unknown models,
# over-limit values, unsupported and unknown fields.
CASES = [
    (CHAT, {}),
    (CHAT, {"temperature": 0.5}),
    (CHAT, {"temperature": 3}),
    (CHAT, {"temperature": "hot"}),
    (CHAT, {"top_p": 0.9}),
    (CHAT, {"top_p": 0}),
    (CHAT, {"top_k": 5}),
    (CHAT, {"top_k": -1}),
    (CHAT, {"top_k": -2}),
    (CHAT, {"top_k": 2**64}),  # past what the wire carries: was a 500 (and stalled a client)
    (CHAT, {"top_k": 1e308}),
    (CHAT, {"messages": [{"role": "user", "content": "Say hi.", "name": "ann"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "Say hi.", "name": {"a": 1}}]}),  # was 200
    (CHAT, {"seed": 3}),
    (CHAT, {"seed": 1.5}),
    (CHAT, {"seed": 2**64}),
    (CHAT, {"n": 2, "seed": 2**64 - 1, "temperature": 1.0}),  # seed + 1 wraps, was a 500
    (CHAT, {"stop": "x"}),
    (CHAT, {"stop": ["a", "b"]}),
    (CHAT, {"stop": [""]}),
    (CHAT, {"stop": ["s"] * 17}),
    (CHAT, {"presence_penalty": 0.5, "frequency_penalty": -0.5}),
    (CHAT, {"presence_penalty": 2.5}),
    (CHAT, {"repetition_penalty": 1.2}),
    (CHAT, {"repetition_penalty": 0}),
    (CHAT, {"ignore_eos": True}),
    (CHAT, {"ignore_eos": "yes"}),
    (CHAT, {"min_tokens": 2}),
    (CHAT, {"min_tokens": 5}),
    (CHAT, {"stop_token_ids": [5, 7]}),
    (CHAT, {"stop_token_ids": [-1]}),
    (CHAT, {"include_stop_str_in_output": True}),
    (CHAT, {"logprobs": True}),
    (CHAT, {"logprobs": True, "top_logprobs": 2}),
    (CHAT, {"top_logprobs": 2}),
    (CHAT, {"logprobs": True, "top_logprobs": 21}),
    (CHAT, {"max_tokens": DROP, "max_completion_tokens": 3}),
    (CHAT, {"max_tokens": 0}),
    (CHAT, {"max_tokens": 100000}),
    (CHAT, {"max_completion_tokens": 5000}),
    (CHAT, {"n": 1}),
    (CHAT, {"n": 3, "seed": 11, "temperature": 1.0}),  # fans out: seed + sample
    (CHAT, {"n": 1000}),
    (CHAT, {"priority": 5}),
    (CHAT, {"priority": 2**40}),
    (CHAT, {"lane": "nowhere"}),
    (CHAT, {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}),
    (CHAT, {"stream": False}),
    (CHAT, {"stream_options": {"include_usage": True}}),
    (CHAT, {"tools": [{"type": "function"}]}),
    (CHAT, {"response_format": {"type": "json_object"}}),
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
    ),
    (CHAT, {"structured_outputs": {"choice": ["a", "b"]}}),
    (CHAT, {"tool_choice": "auto"}),
    (CHAT, {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    (CHAT, {"tools": [TOOL], "messages": [{"role": "user", "content": "x"}, *TOOL_TURN]}),
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    (CHAT, {"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}),
    (CHAT, {"tool_choice": "none", "skip_special_tokens": True}),
    (CHAT, {"skip_special_tokens": False}),
    (CHAT, {"foo": 1}),
    (CHAT, {"model": "gpt-4o"}),
    (CHAT, {"model": "synthetic"}),  # the name the synthetic worker reports
    (CHAT, {"model": ""}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": "hi"}),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}),
    (
        CHAT,
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "Be"}]},
                {"role": "user", "content": "brief."},
            ]
        },
    ),  # fmt: skip
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 9000}]}),
    (TEXT, {}),
    (TEXT, {"max_tokens": DROP}),  # the legacy default, 16
    (TEXT, {"logprobs": 2}),
    (TEXT, {"logprobs": 6}),
    (TEXT, {"logprobs": True}),
    (TEXT, {"prompt": [1, 2, 3]}),
    (TEXT, {"prompt": [[1, 2, 3]]}),
    (TEXT, {"prompt": ["one prompt"]}),
    (TEXT, {"prompt": ["a", [1, 2]], "n": 2, "seed": 4}),  # choices k = prompt * n + sample
    (TEXT, {"prompt": ["x"] * 65}),
    (TEXT, {"prompt": [1, 2, 10**9]}),
    (TEXT, {"prompt": ""}),
    (TEXT, {"prompt": 5}),
    (TEXT, {"prompt": "hello " * 9000}),
    (TEXT, {"prompt": "hello " * 8000, "max_tokens": 500}),
    (TEXT, {"echo": True}),
    (TEXT, {"echo": True, "logprobs": 1, "max_tokens": 0}),
    (TEXT, {"echo": "yes"}),
    (TEXT, {"prompt_logprobs": 2}),
    (TEXT, {"prompt_logprobs": 21}),
    (CHAT, {"min_p": 0.1}),
    (CHAT, {"min_p": 2}),
    (CHAT, {"logit_bias": {"5": 10}}),
    (CHAT, {"logit_bias": {"x": 1}}),
    (TEXT, {"logit_bias": {"7": -101}}),
    (TEXT, {"suffix": "x"}),
    (TEXT, {"best_of": 1}),
    (TEXT, {"best_of": 3}),
    (TEXT, {"top_logprobs": 2}),
    (TEXT, {"ignore_eos": True, "stop_token_ids": [2], "seed": 9, "temperature": 1.0}),
]
# What a batch line cannot do (one line = one non-streamed request in the batch lane): the API
# accepts these, a batch line names why not.
BATCH_ONLY = [
    (CHAT, {"stream": True}, "stream must be false in a batch"),
    (CHAT, {"lane": "interactive"}, "a batch line runs in the batch lane"),
]


def body_of(endpoint: str, changes: dict) -> dict:
    body = {**BASE[endpoint], **changes}
    return {k: v for k, v in body.items() if v is not DROP}


@dataclass
class Gateway:
    run: Callable[[Any], Any]  # run a coroutine on the gateway's event loop
    http: httpx.AsyncClient
    submitted: list[dict]  # keyword arguments of every BrokerClient.submit call
    served: Any  # the ServedModel the gateway loaded

    def post(self, endpoint: str, body: dict) -> tuple[httpx.Response, list[dict]]:
        self.submitted.clear()
        r = self.run(self.http.post(endpoint, json=body, timeout=60))
        return r, list(self.submitted)


@pytest.fixture(scope="module")
def gateway(synth_stack: Stack, smollm2_gguf, tmp_path_factory) -> Iterator[Gateway]:
    """The real app on its own event loop thread, in front of the stack's broker."""
    from laneserve.api.app import create_app
    from laneserve.api.config import ApiConfig

    db = tmp_path_factory.mktemp("parity") / "gateway.db"
    config = ApiConfig(
        broker=synth_stack.front,
        model=str(smollm2_gguf),
        served_model_name=MODEL,
        db_url=f"sqlite:///{db}",
    )
    app = create_app(config)
    state = app.state.gateway
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    run(state.start())
    submitted: list[dict] = []
    real_submit = state.client.submit

    def recording_submit(**kwargs: Any) -> Any:
        submitted.append(kwargs)
        return real_submit(**kwargs)

    state.client.submit = recording_submit
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    try:
        yield Gateway(run, http, submitted, state.model_info)
    finally:
        run(http.aclose())
        run(state.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    """The jobs runner's served model for the same stack: the gateway's name, plus the model
    the broker's worker reports (the runner adds those as the gateway does)."""
    model = load_served_model(str(smollm2_gguf), MODEL)
    return dataclasses.replace(model, aliases=("synthetic",))


def batch_line(tmp_path, served, endpoint: str, body: dict) -> tuple[dict | None, list | None]:
    """(error, the sampling params and prompt the runner would submit for each choice) of
    ``body`` as a batch line."""
    line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
    validator = Validator(endpoint=endpoint, counter=served)
    (result,) = validator.lines(write_jsonl(tmp_path / "in.jsonl", [line]))
    if result.error is not None:
        return result.error, None
    return None, [_sent(_submitted(r)) for r in choice_requests("x", result.request)[1]]


def _submitted(request: EngineRequest) -> dict:
    """What `BrokerClient.submit_request` passes to `submit` for `request`'s prompt fields."""
    return {"sampling_params": request.sampling_params, **request.prompt_fields()}


def _sent(submit_kwargs: dict) -> dict:
    return {k: submit_kwargs.get(k) for k in PROMPT_KEYS}


@pytest.mark.parametrize(("endpoint", "changes"), CASES)
def test_batch_line_validates_as_the_api(gateway, served, tmp_path, endpoint, changes) -> None:
    body = body_of(endpoint, changes)
    response, submitted = gateway.post(endpoint, body)
    line_error, line_sampling = batch_line(tmp_path, served, endpoint, body)
    if response.status_code == 200:
        assert line_error is None, (response.json(), line_error)
        assert [_sent(s) for s in submitted] == line_sampling  # tools: the same rendered ids
        return
    error = response.json()["error"]
    assert response.status_code in (400, 404), response.text
    expected = {"code": error["code"], "message": error["message"]}
    if error.get("param") is not None:
        expected["param"] = f"body.{error['param']}"
    assert line_error == expected


def test_the_cases_cover_every_body_field() -> None:
    from laneserve.contracts.openai.requests import CHAT_FIELDS, COMPLETION_FIELDS

    covered = set().union(*(changes for _, changes in CASES), *(c for _, c, _ in BATCH_ONLY))
    assert CHAT_FIELDS | COMPLETION_FIELDS <= covered


@pytest.mark.parametrize(("endpoint", "changes", "why"), BATCH_ONLY)
def test_what_only_a_batch_line_refuses(gateway, served, tmp_path, endpoint, changes, why) -> None:
    body = body_of(endpoint, changes)
    if body.get("stream"):
        status = gateway.run(_stream_status(gateway.http, endpoint, body))
    else:
        status = gateway.post(endpoint, body)[0].status_code
    assert status == 200
    line_error, _ = batch_line(tmp_path, served, endpoint, body)
    assert line_error is not None and line_error["code"] == "invalid_request"
    assert why in line_error["message"]


async def _stream_status(http: httpx.AsyncClient, endpoint: str, body: dict) -> int:
    async with http.stream("POST", endpoint, json=body, timeout=60) as r:
        async for _ in r.aiter_bytes():
            pass
        return r.status_code
