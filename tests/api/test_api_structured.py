"""Structured outputs through the gateway with the official `openai` client (real SmolLM2 worker):
`beta.chat.completions.parse` with a Pydantic model, json_schema / json_object, plain and SSE, on
chat and completions; bad schemas are a 400 before any inference."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

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
