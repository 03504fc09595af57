"""Property-based HTTP testing of the gateway with Schemathesis (issue 22): no 5xx, and every
error is an OpenAI error object (`{"error": {"message", "type", "code", ...}}`).

The operations are the gateway's own routes, read from the OpenAPI document FastAPI builds for
the app (`create_app(...).openapi()`; the gateway does not serve it). Its handlers read raw
requests, so that document names no parameters or bodies: this module adds a string schema for
each path parameter and, for the POST routes that take JSON, a request-body schema of the
OpenAI fields. Schemathesis then sends valid and invalid bodies (both generation modes) to a
real gateway, broker and synthetic worker (`synth_stack`), a bounded number per operation.
"""

from __future__ import annotations

import re

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.harness import API_KEY

MAX_EXAMPLES = 8  # per operation: 19 operations, seconds each on 2 cores

_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"type": "string", "maxLength": 40},
    },
    "required": ["role", "content"],
}
_SAMPLING = {
    "model": {"type": "string", "maxLength": 20},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**31},
    "stream": {"type": "boolean"},
    "stop": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
}
_TOOL = {
    "type": "object",
    "properties": {
        "type": {"enum": ["function", "retrieval"]},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "parameters": {}},
        },
    },
}
BODIES = {
    "/v1/chat/completions": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 3},
            "service_tier": {"enum": ["auto", "default", "priority", "flex"]},
            "tools": {"type": "array", "items": _TOOL, "maxItems": 2},
            "tool_choice": {"enum": ["auto", "none", "required"]},
            "parallel_tool_calls": {"type": "boolean"},
        },
        "required": ["model", "messages"],
    },
    "/v1/completions": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            "prompt": {"type": "string", "maxLength": 60},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            "echo": {"type": "boolean"},
        },
        "required": ["model", "prompt"],
    },
    "/v1/responses": {
        "type": "object",
        "properties": {
            "model": {"type": "string", "maxLength": 20},
            "input": {
                "anyOf": [
                    {"type": "string", "maxLength": 40},
                    {"type": "array", "items": _MESSAGE, "maxItems": 3},
                ]
            },
            "instructions": {"type": "string", "maxLength": 20},
            "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "stream": {"type": "boolean"},
            "store": {"type": "boolean"},
            "previous_response_id": {"type": "string", "maxLength": 12},
            "text": {"type": "object", "properties": {"format": {"type": "object"}}},
        },
        "required": ["model", "input"],
    },
    "/tokenize": {
        "type": "object",
        "properties": {"model": {"type": "string"}, "prompt": {"type": "string", "maxLength": 60}},
        "required": ["prompt"],
    },
    "/detokenize": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "tokens": {"type": "array", "items": {"type": "integer"}, "maxItems": 8},
        },
        "required": ["tokens"],
    },
    "/v1/batches": {
        "type": "object",
        "properties": {
            "input_file_id": {"type": "string", "maxLength": 30},
            "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]},
            "completion_window": {"type": "string", "maxLength": 5},
            "metadata": {"type": "object"},
        },
        "required": ["input_file_id", "endpoint", "completion_window"],
    },
}


def gateway_openapi() -> dict:
    """FastAPI's OpenAPI document of the gateway, with path parameters and JSON bodies."""
    from laneserve.api.app import create_app
    from laneserve.api.config import ApiConfig

    doc = create_app(ApiConfig(broker="ipc:///unused")).openapi()
    for path, ops in doc["paths"].items():
        names = re.findall(r"{(\w+)}", path)
        for method, op in ops.items():
            op["parameters"] = [
                {"name": n, "in": "path", "required": True,
                 "schema": {"type": "string", "minLength": 1, "maxLength": 40}}
                for n in names
            ]  # fmt: skip
            if method == "post" and path in BODIES:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": BODIES[path]}},
                }
    return doc


@pytest.fixture(scope="module")
def api_schema(synth_stack):
    config = schemathesis.Config.from_dict(
        {"generation": {"mode": "all"}, "base-url": synth_stack.url}
    )
    return schemathesis.openapi.from_dict(gateway_openapi(), config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


def _assert_openai_error(response) -> None:
    try:
        body = response.json()
    except ValueError as exc:
        text = response.text[:200]
        raise AssertionError(f"{response.status_code} error is not JSON: {text!r}") from exc
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), f"{response.status_code} without an error object: {body}"
    assert isinstance(error.get("message"), str) and error["message"], body
    assert isinstance(error.get("type"), str) and isinstance(error.get("code"), str), body


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_never_5xx_and_errors_are_openai_objects(case, synth_stack) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = case.call(base_url=synth_stack.url, headers=headers, timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    )
    if response.status_code >= 400:
        _assert_openai_error(response)
