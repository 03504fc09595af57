"""Tool calls out of a model's reply: the parsers vLLM names ``hermes``, ``llama3_json`` and
``mistral``, the reply message, and the streamed ``tool_calls`` deltas.

What each parser reads (special tokens are already left out of the text, so Llama's
``<|python_tag|>`` and Mistral's ``[TOOL_CALLS]`` may or may not be there):

- ``hermes`` (Hermes, Qwen 2.5/3, and laneserve's fallback prompt): content, then one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
- ``llama3_json`` (Llama 3.1-3.3): the reply is one or more ``{"name": ..., "parameters": {...}}``
  objects (separated by ``;`` or whitespace), nothing else;
- ``mistral``: the reply is ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.

A call names one of the request's functions and carries an arguments object; a reply that does
not parse into such calls is plain content (``tool_choice: "auto"`` falls back to text). With
``required`` or a named function the grammar made the reply JSON (:mod:`.tools`): an array of
calls, or the named function's arguments.

Streaming (:class:`ToolStream`): content streams until the text may begin a call (from
``<tool_call>`` on, or from a leading ``{`` / ``[`` for the parsers whose calls fill the whole
reply); what follows is held and sent when the choice ends, one ``tool_calls`` delta per call
carrying its ``index``, ``id``, ``type``, ``function.name`` and whole ``function.arguments``, as
OpenAI's chunks can. A named function streams its arguments as they are generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from laneserve.contracts.openai.tools import ToolRequest, supports_tools

PARSERS = ("hermes", "llama3_json", "mistral")
HERMES_START = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_LEADING = {"llama3_json": "{", "mistral": "["}  # their calls are the whole reply


def parser_for_template(template: str | None) -> str:
    """The parser a chat template implies (vLLM's names); ``hermes`` for the fallback prompt."""
    if not supports_tools(template):
        return "hermes"
    assert template is not None
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if HERMES_START in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def call_id() -> str:
    """A tool call id in OpenAI's form (``call_`` and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class Parsed:
    """Calls found in a reply: ``start`` is where the calls begin (the content is before it);
    each call ``{"name", "arguments"}`` with ``arguments`` as JSON text."""

    start: int
    calls: list[dict] = field(default_factory=list)


def parse_reply(text: str, tools: ToolRequest, parser: str) -> Parsed | None:
    """The calls of a whole reply, or None when it is plain content. A named function's reply
    is its arguments, even when cut short by ``max_tokens`` (the finish reason tells)."""
    if tools.choice == "function":  # the arguments as generated (and as streamed)
        return Parsed(0, [{"name": tools.name, "arguments": text}])
    if tools.choice == "required":
        objects, start = _json_values(text.strip(), "["), 0
        objects = objects[0] if len(objects) == 1 and isinstance(objects[0], list) else None
    elif parser == "hermes":
        start = text.find(HERMES_START)
        objects = None if start < 0 else _hermes_objects(text[start:])
    else:
        body = text.strip().removeprefix("[TOOL_CALLS]").removeprefix("<|python_tag|>")
        start, objects = 0, _json_values(body.strip(), _LEADING[parser])
        if parser == "mistral":
            objects = objects[0] if len(objects) == 1 and isinstance(objects[0], list) else None
    calls = [_valid_call(o, tools) for o in objects or ()]
    if not calls or None in calls:
        return None
    return Parsed(start, calls if tools.parallel else calls[:1])  # type: ignore[arg-type]


def reply_message(text: str, tools: ToolRequest, parser: str, finish: str) -> tuple[dict, str]:
    """``(message, finish_reason)`` of a finished chat choice: tool calls (``finish_reason``
    ``"tool_calls"`` when the model stopped by itself) or the text as content."""
    parsed = parse_reply(text, tools, parser)
    if parsed is None:
        return {"role": "assistant", "content": text}, finish
    calls = [{"id": call_id(), "type": "function", "function": c} for c in parsed.calls]
    content = text[: parsed.start].strip() or None
    return {"role": "assistant", "content": content, "tool_calls": calls}, _finish(finish)


def apply_tools(choice: dict, tools: ToolRequest, parser: str) -> dict:
    """A whole ``chat.completion`` choice (:func:`..responses.choice`) with its reply read for
    tool calls (:func:`reply_message`); unchanged with ``tool_choice: "none"``."""
    if tools.choice != "none":
        text = choice["message"]["content"]
        choice["message"], choice["finish_reason"] = reply_message(
            text, tools, parser, choice["finish_reason"]
        )
    return choice


def _finish(finish: str) -> str:
    return "tool_calls" if finish == "stop" else finish


class ToolStream:
    """One streamed chat choice with tools: text deltas in, OpenAI ``delta`` objects out."""

    def __init__(self, tools: ToolRequest, parser: str) -> None:
        self.tools, self.parser = tools, parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content (or, named, as arguments)
        self.called = False

    def feed(self, piece: str) -> list[dict]:
        """The deltas to send for a new piece of text (none while it may be a call)."""
        self.text += piece
        if self.tools.choice == "function":
            return self._arguments(piece)
        held = self._held_from()
        if held <= self.sent:
            return []
        out = [{"content": self.text[self.sent : held]}]
        self.sent = held
        return out

    def close(self, finish: str) -> tuple[list[dict], str]:
        """The deltas that end the choice and its ``finish_reason``."""
        if self.tools.choice == "function":
            out = self._arguments("") if not self.called else []
            return out, _finish(finish)
        parsed = parse_reply(self.text, self.tools, self.parser)
        if parsed is None:
            rest = self.text[self.sent :]
            return ([{"content": rest}] if rest else []), finish
        out = []
        if self.text[self.sent : parsed.start].strip():
            out.append({"content": self.text[self.sent : parsed.start].rstrip()})
        for i, fn in enumerate(parsed.calls):
            call = {"index": i, "id": call_id(), "type": "function", "function": fn}
            out.append({"tool_calls": [call]})
        return out, _finish(finish)

    def _arguments(self, piece: str) -> list[dict]:
        if self.called:
            return (
                [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []
            )
        self.called = True
        fn = {"name": self.tools.name, "arguments": piece}
        return [{"tool_calls": [{"index": 0, "id": call_id(), "type": "function", "function": fn}]}]

    def _held_from(self) -> int:
        """Where the text that may still be a call begins."""
        text = self.text
        if self.tools.choice == "required":
            return 0
        if self.parser in _LEADING:
            lead = text.lstrip()
            return 0 if not lead or lead[0] == _LEADING[self.parser] else len(text)
        at = text.find(HERMES_START)
        if at >= 0:
            return at
        for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
            if text.endswith(HERMES_START[:k]):
                return len(text) - k
        return len(text)


def _hermes_objects(text: str) -> list[Any] | None:
    out = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            out.append(json.loads(block))
        except json.JSONDecodeError:
            return None
    return out


def _json_values(text: str, lead: str) -> list[Any]:
    """The JSON values ``text`` holds one after another (``;`` or whitespace between them);
    [] when it does not start with ``lead`` or something else is in it."""
    if not text.startswith(lead):
        return []
    decoder, pos, out = json.JSONDecoder(), 0, []
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return []
        out.append(value)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return out


def _valid_call(obj: Any, tools: ToolRequest) -> dict | None:
    """``{"name", "arguments"}`` (arguments as JSON text) of a call naming one of the tools."""
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return _call(obj["name"], args) if isinstance(args, dict) else None


def _call(name: str | None, args: dict) -> dict:
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}
