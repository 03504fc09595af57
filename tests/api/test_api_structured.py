"""Structured outputs through the gateway with the official `openai` client (real SmolLM2 worker):
`beta.chat.completions.parse` with a Pydantic model, json_schema / json_object, plain and SSE, on
chat and completions; bad schemas are a 400 before any inference. Tool calls forced by the same
grammar engine (`tool_choice` "required" or a named function), plain and streamed, a tool result
rendered into the next prompt, and the SDK's pydantic tools (what instructor's TOOLS mode sends)."""

from __future__ import annotations

import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.harness import API_KEY, Stack

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ITEM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "price": {"type": "number", "minimum": 0, "maximum": 100},
        "size": {"enum": ["S", "M", "L"]},
        "parts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["title", "price", "size", "parts"],
    "additionalProperties": False,
}
ITEM_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "item", "schema": ITEM, "strict": True},
}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


@pytest.fixture
def client(real_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_stack.url + "/v1", api_key=API_KEY, max_retries=0)


def test_parse_with_a_pydantic_model_gives_objects_for_20_prompts(client) -> None:
    parse = getattr(client, "beta", client).chat.completions.parse

    def one(i: int):
        messages = [{"role": "user", "content": f"Invent person number {i}."}]
        return parse(
            model=MODEL, messages=messages, response_format=Person, max_tokens=64, temperature=0
        )

    with ThreadPoolExecutor(8) as pool:  # concurrent: they share engine steps
        results = list(pool.map(one, range(20)))
    for r in results:
        person = r.choices[0].message.parsed
        assert isinstance(person, Person), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


class City(BaseModel):  # bounded: unbounded, the model at 0.7 may write a 100-digit population
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


def test_parse_at_temperature_07_is_compact_json_in_20_of_20(client) -> None:
    """Issue 49 item 4: the grammar leaves no free whitespace, so sampling at temperature 0.7
    cannot pad the object with newlines until max_tokens (LengthFinishReasonError before)."""
    parse = getattr(client, "beta", client).chat.completions.parse

    def one(i: int):
        messages = [{"role": "user", "content": f"Describe city number {i} as JSON."}]
        return parse(
            model=MODEL, messages=messages, response_format=City, max_tokens=128, temperature=0.7
        )

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(20)))
    for r in results:
        content = r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, City), content
        assert r.choices[0].finish_reason == "stop"
        assert "\n" not in content, content  # a raw newline can only be padding between tokens


def test_json_schema_and_json_object_plain_and_streamed(client) -> None:
    kw = {"model": MODEL, "max_tokens": 96, "temperature": 0, "response_format": ITEM_FORMAT}
    messages = [{"role": "user", "content": "Describe a lamp for sale."}]
    whole = client.chat.completions.create(messages=messages, **kw)
    jsonschema.validate(json.loads(whole.choices[0].message.content), ITEM)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(messages=messages, stream=True, **kw)
        if c.choices
    )
    assert text == whole.choices[0].message.content
    sampled = client.chat.completions.create(
        messages=[{"role": "user", "content": "A chair?"}], **{**kw, "temperature": 1.0, "seed": 5}
    )
    jsonschema.validate(json.loads(sampled.choices[0].message.content), ITEM)

    completion = client.completions.create(
        model=MODEL, prompt="A JSON object describing a cat:", max_tokens=64, temperature=0,
        extra_body={"response_format": {"type": "json_object"}, "stop": None},
    )  # fmt: skip
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].text), dict)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="Pick one:",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"structured_outputs": {"choice": ["cat", "dog"]}},
        )  # fmt: skip
        if c.choices
    )
    assert streamed in ("cat", "dog")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {f"k{i}": {"description": "d" * 100} for i in range(10_000)}}}}}, "at most"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_and_no_ops_are_fine(client, extra, needle) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, extra_body=extra
        )
    assert needle in info.value.message
    ok = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, response_format={"type": "text"},
        tool_choice="none", extra_body={"skip_special_tokens": True},
    )  # fmt: skip
    assert ok.choices[0].message.content is not None


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, names) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(chunks) -> tuple[dict[int, dict], str | None]:
    """Tool calls put together from stream deltas as the SDK's docs do, and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        assert not choice.delta.content, "a forced call streamed content"
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            assert d.id is None or d.id == call["id"]
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_tool_calls_validate_plain_and_streamed(client, choice) -> None:
    named = {"type": "function", "function": {"name": choice}}
    tool_choice = choice if choice == "required" else named
    kw = {"model": MODEL, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 96}

    def one(i: int):
        messages = [{"role": "user", "content": f"Question {i}: the weather or the time?"}]
        return client.chat.completions.create(
            messages=messages, temperature=0.8, seed=i, parallel_tool_calls=i % 2 == 0, **kw
        )

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(20)))
    names = {"get_weather"} if choice == "get_weather" else set(SCHEMAS)
    for r in results:
        message = r.choices[0].message
        _check_calls(message.tool_calls, names)
        assert message.content is None and r.choices[0].finish_reason == "tool_calls"
        assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert len(results[1].choices[0].message.tool_calls) == 1  # parallel_tool_calls=False
    calls, finish = _streamed_calls(
        client.chat.completions.create(messages=ASK, stream=True, temperature=0, **kw)
    )
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["name"] in names and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_tool_result_round_trips_into_the_prompt(client, real_stack) -> None:
    kw = {"model": MODEL, "tools": TOOLS, "max_tokens": 48, "temperature": 0}
    first = client.chat.completions.create(
        messages=ASK, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw
    )
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True)]

    def answer(result: str):
        tool = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result}
        return client.chat.completions.create(messages=[*history, tool], **kw)

    short, long = answer("18 C"), answer("18 C, clear sky, wind 10 km/h from the west")
    assert short.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert long.usage.prompt_tokens > short.usage.prompt_tokens  # the result is in the prompt
    tool = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}
    counted = httpx.post(
        real_stack.url + "/tokenize",
        json={"messages": [*history, tool], "tools": TOOLS, "return_token_strs": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert counted["count"] == short.usage.prompt_tokens  # /tokenize renders tools the same
    assert "18 C" in "".join(counted["token_strs"]) and "get_time" in "".join(counted["token_strs"])
    reply = short.choices[0]
    assert reply.message.content or reply.message.tool_calls  # auto: text or a parsed call
    with pytest.raises(openai.BadRequestError) as info:  # a result for a call never made
        client.chat.completions.create(
            messages=[*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "?"}], **kw
        )
    assert info.value.body["param"] == "messages" and "tool_calls" in info.value.message


class Weather(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def test_sdk_pydantic_tools_parse_as_instructor_uses_them(client) -> None:
    parse = getattr(client, "beta", client).chat.completions.parse
    tool = openai.pydantic_function_tool(Weather)
    r = parse(
        model=MODEL, messages=ASK, tools=[tool], max_tokens=64, temperature=0.7,
        tool_choice={"type": "function", "function": {"name": "Weather"}},
    )  # fmt: skip
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather)


# ------------------------------------------------------------------ the Responses API (issue 49)


def test_responses_create_text_with_instructions(client) -> None:
    kw = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    rule, question = "Answer in one short sentence.", "What colour is the sky?"
    r = client.responses.create(instructions=rule, input=question, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.instructions == rule
    assert r.status in ("completed", "incomplete") and r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    # the instructions are the first system message of the prompt
    items = [{"role": "system", "content": rule}, {"role": "user", "content": question}]
    same = client.responses.create(input=items, **kw)
    assert same.usage.input_tokens == r.usage.input_tokens
    assert same.output_text == r.output_text


def test_responses_parse_a_pydantic_model(client) -> None:
    r = client.responses.parse(
        model=MODEL,
        input=[{"role": "user", "content": "Invent a person."}],
        text_format=Person,
        max_output_tokens=64,
        temperature=0.7,
    )
    assert isinstance(r.output_parsed, Person), r.output_text
    assert r.status == "completed"


def test_responses_stream_events_in_order(client) -> None:
    kw = {"model": MODEL, "input": "Count to five.", "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed, or .incomplete when cut
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2  # token by token, not one block
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_tool_and_its_output_round_trip(client, stream) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = {"model": MODEL, "tools": tools, "max_output_tokens": 64, "temperature": 0.7}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "name": "get_weather"}
    if stream:
        with client.responses.stream(input=ask, tool_choice=choice, **kw) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.done" in kinds
    else:
        r = client.responses.create(input=ask, tool_choice=choice, **kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    follow = [
        *ask,
        call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
    ]
    again = client.responses.create(input=follow, tool_choice="none", **kw)
    assert again.output and again.output[0].type == "message"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True, "store": False}, "background"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "int"}}}},
            "text.format",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_responses_bad_input_is_a_400_naming_the_field(real_stack, extra, param) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    r = httpx.post(
        real_stack.url + "/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_responses_previous_response_id_get_and_delete(client, real_stack) -> None:
    kw = {"model": MODEL, "max_output_tokens": 16, "temperature": 0}
    first = client.responses.create(input="My name is Ada. Remember it.", **kw)
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = client.responses.create(previous_response_id=first.id, input="What is my name?", **kw)
    assert second.previous_response_id == first.id
    # the stored turn is the same prompt as the whole conversation sent again, unstored
    whole = [
        {"role": "user", "content": "My name is Ada. Remember it."},
        *[item.model_dump() for item in first.output],
        {"role": "user", "content": "What is my name?"},
    ]
    again = client.responses.create(input=whole, store=False, **kw)
    assert again.store is False
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # not stored
    # another API key's response reads as not found (its owner changed in the table)
    with sqlite3.connect(real_stack.db_path) as db:
        db.execute("UPDATE responses SET owner = 'another key' WHERE id = ?", (second.id,))
    for gone in (second.id, "resp_nothere"):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(previous_response_id=gone, input="And now?", **kw)
        assert err.value.body["param"] == "previous_response_id" and gone in err.value.message
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_responses_background_get_and_cancel(client) -> None:
    """`background: true` answers `queued` at once and runs in the batch lane; GET follows it to
    `completed`; cancel stops a running one (`cancelled`, also when read back), returns a
    finished one as it is, and refuses a response made in the foreground (OpenAI's 400)."""
    kw = {"model": MODEL, "temperature": 0}
    first = client.responses.create(
        input="Name a color.", background=True, max_output_tokens=8, **kw
    )
    assert first.background is True and first.status in ("queued", "in_progress")
    done = first
    deadline = time.monotonic() + 50
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        done = client.responses.retrieve(first.id)
    assert done.status in ("completed", "incomplete") and done.output_text, done
    assert client.responses.cancel(first.id).status == done.status  # finished: as it is
    long = client.responses.create(
        input="Write a long story about the sea.", background=True, max_output_tokens=2000, **kw
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)
    assert client.responses.retrieve(long.id).status == "cancelled"
    plain = client.responses.create(input="Hi", max_output_tokens=2, **kw)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(plain.id)
    assert "Only background responses can be cancelled" in err.value.message
