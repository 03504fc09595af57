"""Wire vocabulary, size limits and field checkers shared by every message.

A checker takes ``(field name, value)`` and returns the (possibly normalized) value, or raises
:class:`ProtocolError`. :func:`spec` attaches one to a message dataclass field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# One definition each, in the OpenAI layer: a prompt or message body (also an error message's cap),
# chat messages in one request, the lane names, the sampling keys.
from laneserve.contracts.openai.requests import LANES as LANES
from laneserve.contracts.openai.requests import MAX_MESSAGES as MAX_MESSAGES
from laneserve.contracts.openai.requests import MAX_TEXT_CHARS, SAMPLING_KEYS

# Size limits. MAX_MESSAGE_BYTES is also the ZMQ_MAXMSGSIZE set on every socket: a peer that
# sends a larger frame is disconnected by libzmq before Python sees it.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
MAX_ID_CHARS = 256  # request ids, worker ids, model names, codes
MAX_TOKEN_IDS = 1_048_576  # prompt_token_ids / token_ids in one message
MAX_STEP_OUTPUTS = 8192  # requests touched in one engine step
MAX_RECORDS = 10_000  # records or snapshots in one RecordBatch
MAX_MAP_ITEMS = 256  # keys in a free-form dict (sampling params, stats, usage, timings)
MAX_NESTING = 8  # nesting depth of free-form values
MAX_TOKEN_ID = 2**31 - 1

FINISH_REASONS = ("stop", "length", "abort", "error")
TASKS = ("generate", "embed")  # a request's kind: sample tokens, or pool its prompt (embeddings)
MAX_EMBEDDING_BYTES = 4 * 65536  # one float32 vector of up to 65,536 dimensions
SAMPLING_FIELDS = frozenset(SAMPLING_KEYS)
"""Keys allowed in a wire ``sampling_params`` map: the OpenAI layer's one list."""

ERROR_CODES = (
    "invalid_request",
    "prompt_too_long",
    "unauthorized",
    "not_found",
    "payload_too_large",
    "overloaded",
    "no_worker",
    "worker_lost",
    "deadline_exceeded",
    "engine_error",
    "internal",
)


class ProtocolError(ValueError):
    """A message that is not valid laneserve protocol (see the module docstring)."""


# --------------------------------------------------------------------------------------------
# Field checkers: each takes (name, value) and returns the (possibly normalized) value.

Check = Callable[[str, Any], Any]


def fail(name: str, what: str) -> ProtocolError:
    return ProtocolError(f"field {name!r}: {what}")


def t_str(max_chars: int = MAX_ID_CHARS, choices: Sequence[str] | None = None) -> Check:
    def check(name: str, v: Any) -> str:
        if type(v) is not str:
            raise fail(name, f"expected str, got {type(v).__name__}")
        if len(v) > max_chars:
            raise fail(name, f"longer than {max_chars} characters")
        if choices is not None and v not in choices:
            raise fail(name, f"{v[:40]!r} not one of {list(choices)}")
        return v

    return check


def t_int(lo: int = -(2**63), hi: int = 2**63 - 1) -> Check:
    def check(name: str, v: Any) -> int:
        if type(v) is not int:
            raise fail(name, f"expected int, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise fail(name, f"{v} outside [{lo}, {hi}]")
        return v

    return check


def t_float(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(name: str, v: Any) -> float:
        if type(v) not in (int, float):
            raise fail(name, f"expected number, got {type(v).__name__}")
        if math.isnan(v) or not lo <= v <= hi:
            raise fail(name, f"{v} outside [{lo}, {hi}]")
        return float(v)

    return check


def t_bool(name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise fail(name, f"expected bool, got {type(v).__name__}")
    return v


def t_bytes(max_bytes: int) -> Check:
    def check(name: str, v: Any) -> bytes:
        if type(v) is not bytes:
            raise fail(name, f"expected bytes, got {type(v).__name__}")
        if len(v) > max_bytes:
            raise fail(name, f"longer than {max_bytes} bytes")
        return v

    return check


def t_opt(inner: Check) -> Check:
    def check(name: str, v: Any) -> Any:
        return None if v is None else inner(name, v)

    return check


def t_token_ids(max_items: int = MAX_TOKEN_IDS) -> Check:
    def check(name: str, v: Any) -> list[int]:
        if type(v) is not list:
            raise fail(name, f"expected list of int, got {type(v).__name__}")
        if len(v) > max_items:
            raise fail(name, f"more than {max_items} token ids")
        for t in v:
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise fail(name, f"invalid token id {t!r}")
        return v

    return check


def _check_plain(name: str, v: Any, depth: int) -> None:
    """Free-form values: None, bool, int, float, str, list, dict with str keys (bounded)."""
    tv = type(v)
    if v is None or tv in (bool, int, float):
        return
    if tv is str:
        if len(v) > MAX_TEXT_CHARS:
            raise fail(name, "string too long")
        return
    if depth >= MAX_NESTING:
        raise fail(name, f"nested deeper than {MAX_NESTING}")
    if tv is list:
        if len(v) > MAX_TOKEN_IDS:
            raise fail(name, "list too long")
        for item in v:
            _check_plain(name, item, depth + 1)
        return
    if tv is dict:
        if len(v) > MAX_MAP_ITEMS * 64:
            raise fail(name, "map too large")
        for k, item in v.items():
            if type(k) is not str or len(k) > MAX_ID_CHARS:
                raise fail(name, f"map key {k!r} is not a short string")
            _check_plain(name, item, depth + 1)
        return
    raise fail(name, f"unsupported value type {tv.__name__}")


def t_map(max_items: int = MAX_MAP_ITEMS, keys: frozenset[str] | None = None) -> Check:
    def check(name: str, v: Any) -> dict:
        if type(v) is not dict:
            raise fail(name, f"expected map, got {type(v).__name__}")
        if len(v) > max_items:
            raise fail(name, f"more than {max_items} keys")
        if keys is not None:
            unknown = [k for k in v if k not in keys]
            if unknown:
                raise fail(name, f"unknown keys {sorted(map(str, unknown))[:5]}")
        _check_plain(name, v, 1)
        return v

    return check


def t_list(inner: Check, max_items: int) -> Check:
    def check(name: str, v: Any) -> list:
        if type(v) is not list:
            raise fail(name, f"expected list, got {type(v).__name__}")
        if len(v) > max_items:
            raise fail(name, f"more than {max_items} items")
        return [inner(name, item) for item in v]

    return check


def t_any(name: str, v: Any) -> Any:
    _check_plain(name, v, 1)
    return v


def t_chat_message(name: str, v: Any) -> dict:
    if type(v) is not dict or type(v.get("role")) is not str:
        raise fail(name, "each chat message must be a map with a string 'role'")
    _check_plain(name, v, 1)
    return v


def spec(check: Check, default: Any = dataclass, **kw: Any) -> Any:
    """A dataclass field carrying its wire checker in metadata."""
    if default is dataclass:
        return field(metadata={"check": check}, **kw)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"check": check})
    return field(default=default, metadata={"check": check})


def one_prompt(kind: str, prompt: Any, messages: Any, prompt_token_ids: Any) -> None:
    """Exactly one of the three prompt forms (``submit`` and ``request``); raises ProtocolError."""
    given = sum(x is not None for x in (prompt, messages, prompt_token_ids))
    if given != 1:
        raise ProtocolError(
            f"{kind}: exactly one of prompt, messages, prompt_token_ids is required"
        )
