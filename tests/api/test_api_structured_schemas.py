"""`response_format` / `structured_outputs` validation at the edge (contracts.openai.structured;
no processes): the wire spec each form becomes, and a 400 naming the problem for anything the
grammar library cannot enforce."""

from __future__ import annotations

import json

import pytest

from laneserve.contracts.openai import Limits, OpenAIError, parse_chat, parse_completion
from laneserve.contracts.openai.structured import MAX_SCHEMA_CHARS, _byte_tokenizer

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_chat({"model": "m", "messages": MSG, **kw}, Limits())


def err(**kw) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        chat(**kw)
    assert info.value.status == 400
    return info.value


def json_schema(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, **extra}}


def test_forms_become_one_wire_spec() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = chat(response_format=json_schema(schema, strict=False)).sampling["structured_outputs"]
    assert spec == {
        "json": '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},'
        '"x-guidance":{"whitespace_flexible":false}}'  # compact JSON: no free whitespace
    }
    assert list(json.loads(spec["json"])["properties"]) == ["b", "a"]  # the generation order
    assert chat(response_format={"type": "json_object"}).sampling["structured_outputs"] == {
        "json_object": True
    }
    assert "structured_outputs" not in chat(response_format={"type": "text"}).sampling
    vllm = chat(structured_outputs={"json": json.dumps(schema)}).sampling["structured_outputs"]
    assert vllm == spec
    assert chat(structured_outputs={"regex": "[0-9]+"}).sampling["structured_outputs"] == {
        "regex": "[0-9]+"
    }
    assert chat(structured_outputs={"choice": ["a", "b"]}).sampling["structured_outputs"] == {
        "choice": ["a", "b"]
    }
    req = parse_completion(
        {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}, Limits()
    )
    assert req.sampling["structured_outputs"] == {"json_object": True}


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"response_format": "json"}, "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": json_schema([1, 2])}, "must be an object, got array"),
        ({"response_format": json_schema({"type": "integr"})}, "Invalid type: integr"),
        ({"response_format": json_schema({"not": {"type": "string"}})}, "Unimplemented keys"),
        (
            {"response_format": json_schema({"type": "array", "uniqueItems": True})},
            "uniqueItems",
        ),
        ({"response_format": json_schema({"type": "string", "format": "colour"})}, "format"),
        ({"response_format": json_schema({"$ref": "#/$defs/none"})}, "does not exist"),
        (
            {"response_format": json_schema({"type": "string", "minLength": 3, "maxLength": 1})},
            "Unsatisfiable",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name"),
        ({"response_format": json_schema({}, strict="yes")}, "strict"),
        ({"response_format": json_schema({}, colour=1)}, "colour"),
        ({"structured_outputs": {"regex": "[a-"}}, "regex"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"grammar": "start: x"}}, "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(kw, needle) -> None:
    assert needle in err(**kw).message


def test_a_huge_schema_is_refused_before_any_grammar_work() -> None:
    props = {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(10_000)}
    e = err(response_format=json_schema({"type": "object", "properties": props}))
    assert f"at most {MAX_SCHEMA_CHARS}" in e.message and e.param == "response_format"


@pytest.mark.parametrize("regex", ["a{1000000}", "(a?){10000}a{10000}", "(0|[1-9]a{1000000})"])
def test_a_grammar_past_the_lexers_limits_is_a_400_not_a_failed_answer(regex) -> None:
    """These validate, but llguidance builds its lexer lazily and gives up at the first byte
    read ("too many expressions constructed"): that was a 500 in the middle of the answer. The
    edge walks a grammar's first bytes from several first bytes (the third blows up only after
    a 1-9, not after the lowest byte, 0) and refuses it; a large grammar within the limits
    passes."""
    e = err(structured_outputs={"regex": regex})
    assert "too large to enforce" in e.message and "lexer" in e.message, e.message
    assert e.param == "structured_outputs"
    ok = chat(structured_outputs={"regex": "a{20000}"}).sampling["structured_outputs"]
    assert ok == {"regex": "a{20000}"}


def test_tolerated_no_ops_are_accepted() -> None:
    req = chat(tool_choice="none", skip_special_tokens=True, response_format={"type": "text"})
    assert "structured_outputs" not in req.sampling


def test_strict_schemas_and_forced_tool_arguments_take_no_invented_keys() -> None:
    """`strict: true` and a forced tool call read a schema as OpenAI's strict mode does: an
    object naming its properties takes no others (a small model padded answers with invented
    keys), unless the schema says otherwise; a non-strict schema is left as written. The
    grammar then refuses an extra key that the schema as written would have let through."""
    import llguidance

    from laneserve.contracts.openai.tools import parse_tools

    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    open_map = {"type": "object", "additionalProperties": {"type": "integer"}}
    schema = {**city, "properties": {**city["properties"], "tags": open_map}}

    def spec(strict: bool) -> dict:
        fmt = {"name": "City", "schema": schema, "strict": strict}
        body = {
            "model": "m",
            "messages": MSG,
            "response_format": {"type": "json_schema", "json_schema": fmt},
        }
        return json.loads(parse_chat(body, Limits()).sampling["structured_outputs"]["json"])

    assert spec(True)["additionalProperties"] is False
    assert spec(True)["properties"]["tags"] == open_map  # it said otherwise: kept
    assert "additionalProperties" not in spec(False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    named = {"type": "function", "function": {"name": "f"}}
    forced = parse_tools({"tools": tools, "tool_choice": named}).spec()
    assert json.loads(forced["json"])["additionalProperties"] is False

    def accepts(grammar_schema: dict, text: str) -> bool:
        """Whether the grammar of `grammar_schema` takes `text` whole (a byte per token)."""
        grammar = llguidance.LLMatcher.grammar_from_json_schema(grammar_schema)
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert accepts(spec(False), '{"name":"Oslo","extra":1}')
    assert not accepts(spec(True), '{"name":"Oslo","extra":1}')
    assert accepts(spec(True), '{"name":"Oslo","tags":{"a":1}}')
