"""Chat ``messages`` as OpenAI's chat completions take them, validated into what chat templates
read: roles, text-only content (text parts joined), ``developer`` -> ``system``, an assistant's
``tool_calls`` and a tool result's ``tool_call_id`` (each tool result answering an earlier
call). Errors are OpenAIError 400s naming ``messages``.
"""

from __future__ import annotations

from typing import Any

from laneserve.contracts.openai.checks import given, type_name
from laneserve.contracts.openai.errors import invalid
from laneserve.contracts.openai.tools import check_tool_calls, check_tool_results

MAX_TEXT_CHARS = 8 * 1024 * 1024  # a prompt or message body (also the wire protocol's text cap)
MAX_MESSAGES = 4096  # chat messages in one request (also the wire protocol's)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def parse_messages(v: Any) -> list[dict]:
    """Validate chat ``messages`` (roles, text-only content); raises OpenAIError (400)."""
    if type(v) is not list:
        raise invalid(f"'messages' must be an array of messages, got {type_name(v)}", "messages")
    if not v:
        raise invalid("'messages' must not be empty", "messages")
    if len(v) > MAX_MESSAGES:
        raise invalid(f"more than {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if type(m) is not dict:
            raise invalid(f"{where} must be an object, got {type_name(m)}", "messages")
        role = m.get("role")
        if role == "function":
            raise invalid(f"{where}: 'function' messages are deprecated; use 'tool'", "messages")
        if type(role) is not str or role not in CHAT_ROLES:  # {} or [] are unhashable
            raise invalid(f"{where}.role must be one of {sorted(CHAT_ROLES)}", "messages")
        extra = sorted(k for k in set(m) - _MESSAGE_KEYS if not (k in _NULL_KEYS and m[k] is None))
        if extra:
            raise invalid(f"{where}: unknown field(s) {', '.join(extra)}", "messages")
        for key in ("name", "refusal"):  # OpenAI's: strings (refusal null too)
            if m.get(key) is not None and type(m[key]) is not str:
                raise invalid(f"{where}.{key} must be a string", "messages")
        out.append(_message(m, role, where))
    check_tool_results(out)
    return out


_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
# Fields of a returned ChatCompletionMessage that clients send back as null with the history.
_NULL_KEYS = frozenset({"audio", "function_call", "annotations"})


def _message(m: dict, role: str, where: str) -> dict:
    """One message as templates read it: ``developer`` -> ``system``; an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` kept."""
    out = {"role": "system" if role == "developer" else role, "content": _content(m, where)}
    if given(m.get("tool_calls")):
        if role != "assistant":
            raise invalid(f"{where}: only assistant messages carry tool_calls", "messages")
        out["tool_calls"] = check_tool_calls(m["tool_calls"], where)
    if role == "tool":
        if type(m.get("tool_call_id")) is not str:
            raise invalid(f"{where}.tool_call_id is required for 'tool' messages", "messages")
        out["tool_call_id"] = m["tool_call_id"]
    elif m.get("tool_call_id") is not None:
        raise invalid(f"{where}.tool_call_id belongs to 'tool' messages", "messages")
    return out


def _content(m: dict, where: str) -> str:
    content = m.get("content")
    if content is None:
        if m.get("role") == "assistant":
            return ""
        raise invalid(f"{where}.content is required", "messages")
    if type(content) is str:
        text = content
    elif type(content) is list:
        parts = []
        for part in content:
            if (
                type(part) is not dict
                or part.get("type") != "text"
                or type(part.get("text")) is not str
            ):
                raise invalid(
                    f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                    "supported",
                    "messages",
                )
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise invalid(f"{where}.content must be a string or an array of text parts", "messages")
    if len(text) > MAX_TEXT_CHARS:
        raise invalid(f"{where}.content is longer than {MAX_TEXT_CHARS} characters", "messages")
    return text
