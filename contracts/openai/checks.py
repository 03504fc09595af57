"""Typed field checks of OpenAI request bodies: each names the field in its 400.

``null`` counts as "not given" (the checker returns None); JSON's ``2.0`` is accepted as an
integer. Used by :mod:`laneserve.contracts.openai.requests`.
"""

from __future__ import annotations

import math
from typing import Any

from laneserve.contracts.openai.errors import invalid

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024


def unpaired_surrogate(value: Any) -> str | None:
    """Where parsed JSON holds a string (or an object key) with an unpaired UTF-16 surrogate
    (JSON's ``"\\ud800"`` escape alone), as a path like ``messages[0].content``; None when every
    string is valid Unicode. Such a string has no UTF-8 form: the tokenizer, the database and
    the response encoder all refuse it, so the edge rejects it first (a 400, a job line's
    error). Iterative: parsed JSON may nest as deep as the parser allows."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if type(v) is str:
            if not v.isascii() and not _utf8_ok(v):
                return _path(path)
        elif type(v) is dict:
            for k, x in v.items():
                if type(k) is str and not k.isascii() and not _utf8_ok(k):
                    return f"an object key of {_path(path)}"
                if type(x) in (str, dict, list):
                    stack.append(((path, k), x))
        elif type(v) is list:
            for i, x in enumerate(v):
                if type(x) in (str, dict, list):
                    stack.append(((path, i), x))
    return None


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(path: tuple) -> str:
    parts: list[Any] = []
    while path:
        path, key = path
        parts.append(key)
    out = ""
    for key in reversed(parts):
        out += f"[{key}]" if type(key) is int else (f".{key}" if out else str(key))
    return out or "the body"


def given(v: Any) -> bool:
    """False for ``null``, ``[]``, ``{}`` and ``false`` (an optional field left out)."""
    return not (v is None or v is False or v == [] or v == {})


MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; a token id above it is a 400

# What the wire (msgpack) carries: a bound left out is this one, so no integer that passes a
# check fails later when the request is encoded.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


def int_field(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    lo = WIRE_INT_MIN if lo is None else lo
    hi = WIRE_INT_MAX if hi is None else hi
    v = body.get(name)
    if v is None:
        return None
    if type(v) is float and v.is_integer():  # JSON 2.0 from some clients
        v = int(v)
    if type(v) is not int:
        raise invalid(f"'{name}' must be an integer, got {type_name(v)}", name)
    if lo is not None and v < lo:
        raise invalid(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise invalid(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def num_field(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v):
        raise invalid(f"'{name}' must be a finite number, got {type_name(v)}", name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        bracket = "(" if lo_open else "["
        raise invalid(f"'{name}' must be in {bracket}{lo}, {hi}], got {v}", name)
    return float(v)


def bool_field(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) is not bool:
        raise invalid(f"'{name}' must be a boolean, got {type_name(v)}", name)
    return v


def type_name(v: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
    }.get(type(v), "null" if v is None else type(v).__name__)


def stop_strings(v: Any) -> list[str] | None:
    if v is None:
        return None
    items = [v] if type(v) is str else v
    if type(items) is not list or not all(type(s) is str and s for s in items):
        raise invalid("'stop' must be a non-empty string or an array of them", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return items or None


def token_ids(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if (
        type(v) is not list
        or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in v)
        or len(v) > MAX_STOP_TOKEN_IDS
    ):
        raise invalid(f"'{name}' must be an array of at most {MAX_STOP_TOKEN_IDS} token ids", name)
    return v or None


def tolerated_no_ops(body: dict) -> None:
    """Fields accepted only with the value laneserve always has: ``tool_choice: "none"`` on
    ``/v1/completions`` (tools are a chat feature, :mod:`.tools`) and ``skip_special_tokens:
    true`` (text never holds special tokens). Any other value is a 400 naming the field, never
    silently dropped."""
    choice = body.get("tool_choice")
    if choice is not None and choice != "none":
        raise invalid(
            f"'tool_choice' {choice!r} is unsupported here (tools are for /v1/chat/completions)",
            "tool_choice",
        )
    skip = body.get("skip_special_tokens")
    if skip is not None and skip is not True:
        raise invalid(
            f"'skip_special_tokens' {skip!r} is unsupported (special tokens are always left out "
            "of the text; only true)",
            "skip_special_tokens",
        )
