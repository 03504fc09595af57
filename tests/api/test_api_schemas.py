"""Body validation of /v1/chat/completions and /v1/completions (contracts.openai.requests; no
processes, no tokenizer)."""

from __future__ import annotations

import pytest

from laneserve.contracts.openai import Limits, OpenAIError, parse_chat, parse_completion

ApiError = OpenAIError
CFG = Limits(max_n=4, max_tokens_limit=100)
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_chat({"model": "m", "messages": MSG, **kw}, CFG)


def completion(**kw):
    return parse_completion({"model": "m", **kw}, CFG)


def err(fn, *args, **kw) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kw)
    return info.value


def test_chat_defaults_and_sampling_fields() -> None:
    req = chat(
        temperature=0, top_p=0.5, top_k=-1, seed=7, stop="x", max_completion_tokens=9,
        presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.1, ignore_eos=True,
        logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    assert req.kind == "chat" and req.lane == "interactive" and req.n == 1
    assert req.max_tokens == 9 and req.stream and req.include_usage and req.logprobs == 3
    assert req.sampling == {
        "temperature": 0.0, "top_p": 0.5, "top_k": 0, "seed": 7, "stop": ["x"],
        "presence_penalty": 1.0, "frequency_penalty": -1.0, "repetition_penalty": 1.1,
        "ignore_eos": True, "logprobs": 3,
    }  # fmt: skip
    assert req.prompts[0].messages == MSG


def test_lane_and_priority_fields() -> None:
    assert chat(lane="batch").lane == "batch"
    assert chat(priority="batch").lane == "batch"
    req = chat(priority=-3)
    assert req.lane == "interactive" and req.priority == -3
    assert err(chat, lane="bulk").param == "lane"


@pytest.mark.parametrize(
    ("prompt", "forms"),
    [
        ("hello", [("text", "hello")]),
        (["a", "b"], [("text", "a"), ("text", "b")]),
        ([1, 2, 3], [("token_ids", [1, 2, 3])]),
        ([[1, 2], [3]], [("token_ids", [1, 2]), ("token_ids", [3])]),
    ],
)
def test_completion_prompt_forms(prompt, forms) -> None:
    req = completion(prompt=prompt)
    assert [(k, getattr(p, k)) for p, (k, _) in zip(req.prompts, forms, strict=True)] == forms


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], None, 5, [1, "a"], [-1], [{"x": 1}]])
def test_completion_bad_prompts(prompt) -> None:
    e = err(completion, prompt=prompt)
    assert e.status == 400 and e.param == "prompt"


def test_unsupported_fields_are_named() -> None:
    e = err(chat, functions=[{"name": "f"}], function_call="auto")
    assert e.status == 400 and "functions" in e.message and "function_call" in e.message
    # not given, in any of the usual spellings: accepted
    chat(tools=None, response_format=None, tool_choice=None, logit_bias={}, user="u")
    assert "frobnicate" in err(chat, frobnicate=1).message
    assert err(completion, prompt="x", suffix="y").param == "suffix"
    assert err(chat, echo=True).param == "echo"  # a /v1/completions field only
    completion(prompt="x", echo=False, best_of=1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", 3),
        ("top_p", 0),
        ("n", "2"),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("stream", "yes"),
        ("stop", [""]),
        ("stop", 5),
        ("seed", "s"),
        ("presence_penalty", 3),
        ("top_logprobs", 2),  # without logprobs: true
        ("logprobs", 3),  # chat logprobs is a boolean
        ("stream_options", {"include_usage": True}),  # without stream
    ],
)
def test_chat_wrong_types_and_ranges(field, value) -> None:
    e = err(chat, **{field: value})
    assert e.status == 400 and e.param == field, e.message


def test_limits() -> None:
    assert err(chat, n=5).param == "n"
    # integers past what the wire carries are 400s naming the field (they were 500s)
    assert err(chat, top_k=2**64).param == "top_k" and err(chat, top_k=1e308).param == "top_k"
    assert err(chat, seed=2**64).param == "seed"
    assert err(chat, n=2**70).message == f"'n' must be <= 4, got {2**70}"
    assert err(chat, max_tokens=2**70).param == "max_tokens"
    assert err(chat, stop_token_ids=[2**64]).param == "stop_token_ids"
    assert err(chat, logit_bias={str(2**64): 1}).param == "logit_bias"
    assert err(chat, logit_bias={"\u00b2": 1}).param == "logit_bias"  # isdigit, but no int
    assert err(completion, prompt=[[1, 2**64]]).param == "prompt"
    fanned = chat(n=2, seed=2**64 - 1, temperature=1.0)
    assert [fanned.sampling_for(i)["seed"] for i in range(2)] == [2**64 - 1, 0]
    assert chat(n=4).n == 4
    assert err(chat, max_tokens=101).param == "max_tokens"
    assert err(chat, max_completion_tokens=101).param == "max_completion_tokens"
    assert err(completion, prompt="x", logprobs=6).param == "logprobs"
    assert completion(prompt="x", logprobs=5).logprobs == 5
    assert err(completion, prompt=["a"] * 40, n=4).param == "n"


def test_messages_validation() -> None:
    assert err(parse_chat, {"model": "m", "messages": []}, CFG).param == "messages"
    assert err(parse_chat, {"model": "m"}, CFG).param == "messages"
    assert err(chat, messages=[{"role": "tool", "content": "x"}]).param == "messages"
    assert err(chat, messages=[{"role": "user", "content": 3}]).param == "messages"
    named = err(chat, messages=[{"role": "user", "content": "x", "name": {"a": 1}}])
    assert named.param == "messages" and "messages[0].name must be a string" in named.message
    assert chat(messages=[{"role": "user", "content": "x", "name": "ann"}]).prompts
    assert chat(messages=[{"role": "assistant", "content": "x", "refusal": None}]).prompts
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert err(chat, messages=[{"role": "user", "content": image}]).param == "messages"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "developer", "content": "s"}, {"role": "user", "content": parts}])
    assert req.prompts[0].messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "ab"},
    ]


def test_body_must_be_an_object_with_a_model() -> None:
    assert err(parse_chat, [1], CFG).status == 400
    assert err(parse_chat, {"messages": MSG}, CFG).param == "model"
    assert err(parse_completion, {"model": 3, "prompt": "x"}, CFG).param == "model"


def test_one_list_of_sampling_keys() -> None:
    """contracts.openai.SAMPLING_KEYS is the wire's list: the broker checks the same keys and
    the engine's SamplingParams has a field for each."""
    from dataclasses import fields

    from laneserve.broker.protocol import SAMPLING_FIELDS
    from laneserve.contracts.openai import SAMPLING_KEYS
    from laneserve.gpu_worker.sampling_params import SamplingParams

    assert len(set(SAMPLING_KEYS)) == len(SAMPLING_KEYS)
    assert set(SAMPLING_KEYS) == SAMPLING_FIELDS
    assert set(SAMPLING_KEYS) <= {f.name for f in fields(SamplingParams)}


@pytest.mark.parametrize("role", [{}, [], 3, None])
def test_chat_role_of_the_wrong_type_is_a_400(role) -> None:
    # Found by Schemathesis (tests/api/test_api_schemathesis.py): an unhashable role was a 500.
    e = err(chat, messages=[{"role": role, "content": "x"}])
    assert e.code == "invalid_request" and "role" in e.message
