"""The Responses API (``POST /v1/responses``) at the edge: its body -> a chat-completions body, and
a finished chat choice -> the ``response`` object and its output items.

A Responses request is a chat request in other words, so it is translated and then validated by
the one chat parser (:func:`laneserve.contracts.openai.requests.parse_chat`): same limits, same
structured outputs (``text.format`` -> ``response_format``), same tool calling
(:mod:`laneserve.contracts.openai.tools`). Field names follow OpenAI's Responses reference and
the shapes of ``openai.types.responses``:

- ``input``: a string (one user message) or a list of items: messages (``role`` user | system |
  developer | assistant, ``content`` a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` (``call_id``, ``name``, ``arguments``) and ``function_call_output``
  (``call_id``, ``output``); ``instructions``: a system message put first;
- ``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``, ``user``,
  ``service_tier``, ``metadata``;
- ``text.format``: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "name",
  "schema", "strict", "description"}`` (flat, unlike chat's ``json_schema`` wrapper);
- ``tools``: ``{"type": "function", "name", "description", "parameters", "strict"}`` (flat);
  ``tool_choice``: ``"none" | "auto" | "required" | {"type": "function", "name"}``.

``store`` (default true) and ``previous_response_id``: :mod:`laneserve.api.response_store`;
``background: true`` runs the response in the batch lane (laneserve/api/response_background.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from laneserve.contracts.openai.checks import given, type_name
from laneserve.contracts.openai.errors import OpenAIError, invalid
from laneserve.contracts.openai.requests import Limits, ParsedRequest, parse_chat

ENDPOINT = "/v1/responses"
# the Responses fields that map one to one onto chat completions fields
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "service_tier")
_OWN = frozenset(
    {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "stream"}
    | {"store", "metadata", "truncation", "previous_response_id", "background", "include"}
)
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
_FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})


# chat fields -> the Responses fields they came from, for the errors the chat parser raises
_RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def parse_response_request(
    body: Any, limits: Limits, history: list[dict] | None = None
) -> ParsedRequest:
    """Validate a Responses body as the chat request it asks for.

    Raises:
        OpenAIError: 400 naming the Responses field (a chat parser's error renamed, its message
            too: ``'max_completion_tokens' ...`` reads ``'max_output_tokens' ...``).
    """
    chat = to_chat_body(body, history)
    try:
        return parse_chat(chat, limits)
    except OpenAIError as exc:
        for old, new in _RENAMED.items():
            if exc.param == old or (exc.param or "").startswith(old + "["):
                exc.param = new + exc.param[len(old) :]
                exc.message = exc.message.replace(f"'{old}", f"'{new}")
                exc.args = (exc.message,)
        raise


def to_chat_body(body: Any, history: list[dict] | None = None) -> dict:
    """The chat-completions body that a Responses body asks for; ``history``: the input items of
    the earlier turns (``previous_response_id``), put before its ``input``.

    Raises:
        OpenAIError: 400 naming the Responses field (``input``, ``text``, ``tools``, ...).
    """
    if type(body) is not dict:
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}", None)
    unknown = sorted(k for k in body if k not in _OWN and k not in _SAME)
    if unknown:
        raise invalid(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    background = body.get("background")
    if background not in (None, False, True):
        raise invalid("'background' must be a boolean", "background")
    if background and body.get("store") is False:
        raise invalid("background responses need 'store': true (the default)", "background")
    if background and body.get("stream") is True:
        raise invalid("'stream' is not supported with 'background': true", "stream")
    for name in ("store", "stream"):
        if body.get(name) not in (None, False, True):
            raise invalid(f"'{name}' must be a boolean", name)
    if given(body.get("include")):
        raise invalid("'include' is not supported", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("'truncation' supports only \"disabled\"", "truncation")
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = _messages(body, history or [])
    if background and "service_tier" not in chat:  # background responses run in the batch lane
        chat["lane"] = "batch"
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if given(body.get("tools")):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def input_items(body: dict) -> list[dict]:
    """A (validated) body's ``input`` as a list of items (a string is one user message)."""
    items = body.get("input")
    if type(items) is str:
        return [{"type": "message", "role": "user", "content": items}]
    return list(items)


def _messages(body: dict, history: list[dict]) -> list[dict]:
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if type(instructions) is not str:
            raise invalid("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(history):
        _item(item, f"previous_response_id (item {i})", messages)
    items = body.get("input")
    if type(items) is not str and (type(items) is not list or not items):
        raise invalid("'input' must be a string or a non-empty array of items", "input")
    for i, item in enumerate(input_items(body)):
        _item(item, f"input[{i}]", messages)
    return messages


def _item(item: Any, where: str, messages: list[dict]) -> None:
    if type(item) is not dict:
        raise invalid(f"'{where}' must be an object, got {type_name(item)}", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise invalid(f"'{where}.role' must be one of {list(_ROLES)}", f"{where}.role")
        messages.append({"role": role, "content": _content(item.get("content"), where)})
    elif kind == "function_call":
        call = {
            "id": _str(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _str(item, "name", where),
                "arguments": _str(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        if last and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if type(output) is not str:
            output = _content(output, where)
        messages.append(
            {"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": output}
        )
    else:
        raise invalid(
            f"'{where}.type' {kind!r} is not supported (message, function_call, "
            "function_call_output)",
            f"{where}.type",
        )


def _str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if type(value) is not str:
        raise invalid(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _content(content: Any, where: str) -> str:
    if type(content) is str:
        return content
    if type(content) is not list:
        raise invalid(
            f"'{where}.content' must be a string or an array of parts", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        if type(part) is not dict or part.get("type") not in _TEXT_PARTS:
            raise invalid(
                f"'{where}.content[{j}]' must be an input_text or output_text part",
                f"{where}.content[{j}]",
            )
        texts.append(_str(part, "text", f"{where}.content[{j}]"))
    return "".join(texts)


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if type(text) is not dict or not set(text) <= {"format", "verbosity"}:
        raise invalid("'text' must be an object with a 'format'", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if type(fmt) is not dict:
        raise invalid("'text.format' must be an object", "text.format")
    unknown = sorted(set(fmt) - _FORMAT_KEYS)
    if unknown:
        raise invalid(f"'text.format' has unknown field(s): {', '.join(unknown)}", "text.format")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _tools(tools: Any) -> list:
    if type(tools) is not list:
        raise invalid(f"'tools' must be an array, got {type_name(tools)}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if type(tool) is not dict or tool.get("type") != "function":
            kind = tool.get("type") if type(tool) is dict else type_name(tool)
            raise invalid(
                f"'tools[{i}].type' {kind!r} is not supported; only function tools are",
                f"tools[{i}].type",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: Any) -> Any:
    if type(choice) is dict and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# ------------------------------------------------------------------------------- output


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict, status: str = "completed") -> list[dict]:
    """The output items of a chat choice's ``message``: a ``message`` item with its text, then a
    ``function_call`` item per tool call."""
    items: list[dict] = []
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(function_item(new_id("fc"), call["id"], fn["name"], fn["arguments"], status))
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_object(
    resp_id: str,
    created: float,
    body: dict,
    output: list[dict],
    status: str,
    usage_: dict | None,
    stored: bool = False,
) -> dict:
    """The ``response`` object (``status``: queued | in_progress | completed | incomplete |
    failed | cancelled; the first and the last two only for ``background`` responses)."""
    text = body.get("text") or {}
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": body.get("background") is True,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": stored,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage_,
        "user": body.get("user"),
    }
