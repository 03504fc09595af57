"""Tool calling at the edge: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a
:class:`ToolRequest`, tool messages checked, and the prompt the model's chat template sees.

Request fields follow OpenAI's chat completions reference:

- ``tools``: function tools ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``; ``name`` matches ``^[a-zA-Z0-9_-]{1,64}$``, ``parameters`` is a
  JSON schema object (left out: no arguments);
- ``tool_choice``: ``"none"`` (tools are left out of the prompt, the reply is text), ``"auto"``
  (the default with tools: the model chooses, its reply parsed by the template's parser),
  ``"required"`` or ``{"type": "function", "function": {"name": ...}}``;
- ``parallel_tool_calls``: ``false`` allows one call per reply.

``required`` and a named function are enforced by the structured-output engine (llguidance), as
vLLM does it: the reply is constrained to JSON -- the named function's arguments object, or for
``required`` an array of ``{"name", "arguments"}`` objects whose ``arguments`` follow that
function's ``parameters`` -- so the call always parses and validates, whatever the model's size.
The grammar is compact (``x-guidance.whitespace_flexible: false``): a small model cannot pad the
JSON with whitespace until ``max_tokens``.

The tools reach the model through its own chat template (``tools=`` as transformers'
``apply_chat_template`` passes them). A template that never mentions ``tools`` gets the generic
fallback instead: a system message listing the tools in Hermes' words, earlier calls written as
``<tool_call>`` blocks and tool results as ``<tool_response>`` user turns (parser ``hermes``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from laneserve.contracts.openai.checks import given, type_name
from laneserve.contracts.openai.errors import invalid
from laneserve.contracts.openai.structured import closed, compact, grammar_error, schema_text

TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's limit of functions per request
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's validated tools.

    ``tools``: the function tools as the request gave them (the template renders them so);
    ``choice``: ``"none" | "auto" | "required" | "function"``; ``name``: the forced function
    when ``choice == "function"``; ``parallel``: more than one call per reply allowed.
    """

    tools: tuple[dict, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The grammar makes the reply a call (``required`` or a named function)."""
        return self.choice in ("required", "function")

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict:
        """The JSON schema of a function's arguments (no ``parameters``: no arguments)."""
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters", NO_PARAMETERS)

    def spec(self) -> dict[str, Any] | None:
        """The wire structured-output spec that forces the call; None unless :attr:`forced`."""
        if self.choice == "function":
            assert self.name is not None
            return {"json": schema_text(compact(closed(self.parameters(self.name))), "tools")}
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": closed(self.parameters(name)),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in self.names
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema_text(compact(schema), "tools")}


# ------------------------------------------------------------------------------- parsing


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools, or None without any (``tool_choice: "none"`` alone is a no-op).

    Raises:
        OpenAIError: 400 naming ``tools``, ``tool_choice`` or ``parallel_tool_calls``: a
            malformed tool, a duplicate or unknown function name, a non-object ``parameters``
            schema, a schema the grammar engine cannot enforce (for a forced call), a
            ``tool_choice`` without ``tools``, or a forced call with ``response_format``.
    """
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not given(raw):
        if raw is not None and type(raw) is not list:
            raise invalid(f"'tools' must be an array, got {type_name(raw)}", "tools")
        if choice is not None and choice != "none":
            raise invalid("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    if type(raw) is not list:
        raise invalid(f"'tools' must be an array, got {type_name(raw)}", "tools")
    if len(raw) > MAX_TOOLS:
        raise invalid(f"'tools' has more than {MAX_TOOLS} functions", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid(f"'tools' names the function {dup!r} twice", "tools")
    kind, name = _choice(choice, names)
    req = ToolRequest(tools, kind, name, parallel is not False)
    if req.forced:
        if body.get("response_format") is not None or body.get("structured_outputs") is not None:
            raise invalid(
                f"'tool_choice' {choice!r} forces a call; it cannot be combined with "
                "'response_format'",
                "tool_choice",
            )
        problem = grammar_error(req.spec() or {})
        if problem:
            raise invalid(f"the tools' parameters cannot be enforced: {problem}", "tools")
    return req


def _tool(t: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if type(t) is not dict:
        raise invalid(f"{where} must be an object, got {type_name(t)}", "tools")
    if t.get("type") != "function":
        raise invalid(f"{where}.type must be 'function', got {t.get('type')!r}", "tools")
    extra = sorted(set(t) - _TOOL_KEYS)
    if extra:
        raise invalid(f"{where}: unknown field(s) {', '.join(extra)}", "tools")
    fn = t.get("function")
    if type(fn) is not dict:
        raise invalid(f"{where}.function must be an object", "tools")
    extra = sorted(set(fn) - _FUNCTION_KEYS)
    if extra:
        raise invalid(f"{where}.function: unknown field(s) {', '.join(extra)}", "tools")
    name = fn.get("name")
    if type(name) is not str or not NAME_RE.match(name):
        raise invalid(
            f"{where}.function.name is required: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'", "tools"
        )
    if fn.get("description") is not None and type(fn["description"]) is not str:
        raise invalid(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters", NO_PARAMETERS)
    if type(params) is not dict:
        raise invalid(
            f"{where}.function.parameters must be a JSON schema object, got {type_name(params)}",
            "tools",
        )
    if params.get("type", "object") != "object":
        raise invalid(f"{where}.function.parameters must describe an object", "tools")
    return t


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if type(choice) is str:
        if choice not in TOOL_CHOICES:
            raise invalid(
                f"'tool_choice' must be one of {list(TOOL_CHOICES)} or a function, got {choice!r}",
                "tool_choice",
            )
        return choice, None
    fn = choice.get("function") if type(choice) is dict else None
    if type(choice) is not dict or choice.get("type") != "function" or type(fn) is not dict:
        raise invalid(
            "'tool_choice' must be a string or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    name = fn.get("name")
    if name not in names:
        raise invalid(
            f"'tool_choice' names the function {name!r}, not one of 'tools'", "tool_choice"
        )
    return "function", name


# ------------------------------------------------------------------------------- messages


def check_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (OpenAI's form, ``arguments`` a JSON string)."""
    if type(calls) is not list:
        raise invalid(f"{where}.tool_calls must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if type(call) is dict else None
        if type(fn) is not dict or call.get("type", "function") != "function":
            raise invalid(f"{at} must be {{'id', 'type': 'function', 'function'}}", "messages")
        if type(call.get("id")) is not str or not call["id"]:
            raise invalid(f"{at}.id must be a non-empty string", "messages")
        if type(fn.get("name")) is not str or type(fn.get("arguments")) is not str:
            raise invalid(f"{at}.function needs 'name' and 'arguments' strings", "messages")
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


def check_tool_results(messages: list[dict]) -> None:
    """Every ``tool`` message answers a call an earlier assistant message made (OpenAI: "messages
    with role 'tool' must be a response to a preceding message with 'tool_calls'")."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            made.add(call["id"])
        if m["role"] == "tool" and m.get("tool_call_id") not in made:
            raise invalid(
                f"messages[{i}]: a 'tool' message must answer a preceding assistant message's "
                f"tool_calls (no call has id {m.get('tool_call_id')!r})",
                "messages",
            )


def uses_tools(messages: list[dict]) -> bool:
    """True when a conversation holds tool calls or tool results."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (else the generic fallback is used)."""
    return bool(template) and "tools" in template


def template_messages(messages: list[dict], native: bool) -> list[dict]:
    """The conversation as chat templates read it: ``arguments`` as objects (transformers'
    convention, what vLLM passes too); without ``native`` support, calls as ``<tool_call>``
    text and results as ``<tool_response>`` user turns."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if native:
            m = dict(m)
            if calls:
                m["tool_calls"] = [_with_object_arguments(c) for c in calls]
        elif calls:
            blocks = [
                "<tool_call>\n" + json.dumps(_call_json(c), ensure_ascii=False) + "\n</tool_call>"
                for c in calls
            ]
            m = {
                "role": "assistant",
                "content": "\n".join([m.get("content") or "", *blocks]).strip(),
            }
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def fallback_system_prompt(tools: tuple[dict, ...]) -> str:
    """The generic tools prompt for templates without tool support (Hermes' / Qwen's wording)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_fallback_prompt(messages: list[dict], tools: tuple[dict, ...]) -> list[dict]:
    """``messages`` with the fallback tools prompt in (or as) the first system message."""
    prompt = fallback_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _call_json(call: dict) -> dict:
    fn = _with_object_arguments(call)["function"]
    return {"name": fn["name"], "arguments": fn["arguments"]}


def _with_object_arguments(call: dict) -> dict:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except (TypeError, json.JSONDecodeError):
        args = fn["arguments"]
    return {**call, "function": {**fn, "arguments": args}}
