"""Structured outputs at the edge: ``response_format`` / ``structured_outputs`` -> a wire spec.

Clients ask for constrained output two ways, both accepted on ``/v1/chat/completions`` and
``/v1/completions`` (and in bulk-job lines, which use the same parser):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (what ``openai``'s ``beta.chat.completions.parse`` sends for a Pydantic model);
- vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a schema object or its JSON text),
  ``regex``, ``choice`` (a list of strings) or ``json_object: true``.

Both become one **wire spec**, the ``structured_outputs`` entry of the wire ``sampling_params``:
a map with exactly one key, msgpack-friendly and usable as a cache key::

    {"json": "<schema as compact JSON text>"} | {"json_object": True}
    | {"regex": "<pattern>"} | {"choice": ["a", "b", ...]}

The schema text is canonical up to whitespace (compact separators, non-ASCII kept); key order is
kept because it is the order the grammar generates an object's properties in.

The grammar library is llguidance (https://github.com/guidance-ai/llguidance): its JSON Schema
compiler refuses, by name, every keyword it cannot enforce ("Unimplemented keys: [...]") and unknown
string formats, so a schema is either enforced completely or answered with a 400 -- never partly
ignored. Validation here needs no tokenizer and no torch (the gateway and the jobs runner run it);
the worker compiles the same grammar (:func:`grammar_of`) against its tokenizer.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from laneserve.contracts.openai.checks import type_name
from laneserve.contracts.openai.errors import invalid

# A schema's compact JSON text: validating costs ~4 ms per 1 KB of schema (a 1 MB schema takes
# seconds), so larger ones are refused before any work. OpenAI's own limits are of the same order
# (100 object properties, 5 nesting levels, 15,000 characters of names and enum values).
MAX_SCHEMA_CHARS = 128 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 4096
SPEC_KINDS = ("json", "json_object", "regex", "choice")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})
COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options: no free whitespace
_COMPACT_OBJECT = json.dumps({"type": "object", "x-guidance": COMPACT})


def parse_structured(body: dict) -> dict[str, Any] | None:
    """The wire spec asked for by a request body, or None for unconstrained output.

    Raises:
        OpenAIError: 400 naming ``response_format`` or ``structured_outputs``: a malformed field,
            both given, or a constraint the grammar library refuses (its message says why).
    """
    fmt = body.get("response_format")
    extra = body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise invalid(
            "give either 'response_format' or 'structured_outputs', not both", "response_format"
        )
    if fmt is not None:
        spec, param = _response_format(fmt), "response_format"
    elif extra is not None:
        spec, param = _structured_outputs(extra), "structured_outputs"
    else:
        return None
    if spec is not None:
        problem = grammar_error(spec)
        if problem:
            raise invalid(f"'{param}' cannot be enforced: {problem}", param)
    return spec


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if type(fmt) is not dict:
        raise invalid(
            f"'response_format' must be an object, got {type_name(fmt)}", "response_format"
        )
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise invalid(
            f"'response_format.type' must be one of {list(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
            "response_format",
        )
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in fmt):
        raise invalid(
            f"'response_format' has unexpected field(s): {', '.join(extra or ['json_schema'])}",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    js = fmt.get("json_schema")
    if type(js) is not dict:
        raise invalid("'response_format.json_schema' must be an object", "response_format")
    unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise invalid(
            f"'response_format.json_schema' has unknown field(s): {', '.join(unknown)}",
            "response_format",
        )
    name = js.get("name")
    if type(name) is not str or not name or len(name) > 64:
        raise invalid(
            "'response_format.json_schema.name' must be a string of 1 to 64 characters",
            "response_format",
        )
    if js.get("strict") is not None and type(js["strict"]) is not bool:
        raise invalid("'response_format.json_schema.strict' must be a boolean", "response_format")
    if "schema" not in js:  # OpenAI: no schema means any JSON object
        return {"json_object": True}
    schema = closed(js["schema"]) if js.get("strict") else js["schema"]
    return {"json": schema_text(compact(schema), "response_format")}


def _structured_outputs(so: Any) -> dict[str, Any]:
    if type(so) is not dict:
        raise invalid(
            f"'structured_outputs' must be an object, got {type_name(so)}", "structured_outputs"
        )
    unknown = sorted(str(k) for k in so if k not in SPEC_KINDS)
    if unknown:
        raise invalid(
            f"'structured_outputs' field(s) not supported: {', '.join(unknown)} "
            f"(supported: {', '.join(SPEC_KINDS)})",
            "structured_outputs",
        )
    given = [k for k in SPEC_KINDS if so.get(k) is not None and so.get(k) is not False]
    if len(given) != 1:
        raise invalid(
            f"'structured_outputs' needs exactly one of {', '.join(SPEC_KINDS)}",
            "structured_outputs",
        )
    kind, value = given[0], so[given[0]]
    if kind == "json":
        if type(value) is str:
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(
                    f"'structured_outputs.json' is not valid JSON: {exc}", "structured_outputs"
                ) from None
        return {"json": schema_text(compact(value), "structured_outputs")}
    if kind == "json_object":
        if value is not True:
            raise invalid("'structured_outputs.json_object' must be true", "structured_outputs")
        return {"json_object": True}
    spec = {kind: value}
    problem = spec_shape_error(spec)
    if problem:
        raise invalid(f"'structured_outputs': {problem}", "structured_outputs")
    return spec


def wants_json(body: dict) -> bool:
    """True when a (validated) body constrains its output to JSON (an object or a schema)."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    if type(fmt) is dict and fmt.get("type") in ("json_object", "json_schema"):
        return True
    return type(extra) is dict and (extra.get("json") is not None or bool(extra.get("json_object")))


def parsed_json(text: str, finish_reason: str | None) -> Any:
    """The value of a JSON-constrained answer (``message.parsed``, as the openai SDK's
    ``parse()`` names it); None when generation stopped early ("length") or it does not parse."""
    if finish_reason != "stop":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def compact(schema: Any) -> Any:
    """`schema` with llguidance's compact JSON option (no free whitespace between tokens), so a
    small model cannot pad its answer with newlines until ``max_tokens``; OpenAI's strict mode
    answers compact JSON too. A schema that sets its own ``x-guidance`` options keeps them."""
    if type(schema) is not dict or "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": COMPACT}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """`schema` with ``additionalProperties: false`` on every object schema that names its
    ``properties`` and does not say otherwise, as OpenAI's strict mode reads a schema: an answer may only use the properties the
    schema names, so a small model cannot pad it with invented keys until ``max_tokens``. What
    the closed schema accepts, the original accepts too."""
    if type(schema) is not dict:
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if type(out.get(key)) is dict:
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if type(out.get(key)) is list:
            out[key] = [closed(sub) for sub in out[key]]
    for key in ("items", "not", "if", "then", "else"):
        if key in out:
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:  # an object with named keys
        out["additionalProperties"] = False
    return out


def schema_text(schema: Any, param: str) -> str:
    """A schema's canonical compact JSON text (key order kept). Raises OpenAIError (400)."""
    if type(schema) is not dict and type(schema) is not bool:
        raise invalid(f"the JSON schema must be an object, got {type_name(schema)}", param)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid(
            f"the JSON schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS} are allowed",
            param,
        )
    return text


def spec_shape_error(spec: Any) -> str | None:
    """What is wrong with the form of a wire spec (None when well formed); no grammar work.

    The worker checks every spec it receives with this (`SamplingParams`)."""
    if type(spec) is not dict or len(spec) != 1:
        return f"a structured-output spec is a map with one of {list(SPEC_KINDS)}"
    ((kind, value),) = spec.items()
    if kind == "json":
        if type(value) is not str or len(value) > MAX_SCHEMA_CHARS:
            return f"'json' must be the schema's JSON text (at most {MAX_SCHEMA_CHARS} characters)"
    elif kind == "json_object":
        if value is not True:
            return "'json_object' must be true"
    elif kind == "regex":
        if type(value) is not str or not value or len(value) > MAX_REGEX_CHARS:
            return f"'regex' must be a non-empty string of at most {MAX_REGEX_CHARS} characters"
    elif kind == "choice":
        if (
            type(value) is not list
            or not 0 < len(value) <= MAX_CHOICES
            or not all(type(c) is str and 0 < len(c) <= MAX_CHOICE_CHARS for c in value)
        ):
            return f"'choice' must be a list of 1 to {MAX_CHOICES} non-empty strings"
    else:
        return f"unknown structured-output kind {kind!r} (one of {list(SPEC_KINDS)})"
    return None


def grammar_of(spec: dict[str, Any]) -> str:
    """The llguidance grammar (its serialized form) of a well-formed wire spec.

    Deterministic: equal specs give equal grammars (the worker's compile cache key)."""
    import llguidance

    ((kind, value),) = spec.items()
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_COMPACT_OBJECT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    # choice: a Lark rule of JSON-quoted literals (Lark strings use JSON's escapes)
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


def grammar_error(spec: dict[str, Any]) -> str | None:
    """Why llguidance cannot enforce `spec` (its message), or None. No tokenizer needed.

    Warnings count as errors: a warned-about feature would not be enforced as written. Answers
    are cached (a bulk job repeats one schema on every line)."""
    problem = spec_shape_error(spec)
    if problem:
        return problem
    return _grammar_error(json.dumps(spec, sort_keys=True, ensure_ascii=False))


@functools.lru_cache(maxsize=256)
def _grammar_error(spec_key: str) -> str | None:
    import llguidance

    spec = json.loads(spec_key)

    try:
        grammar = grammar_of(spec)
    except ValueError as exc:  # not a JSON object
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        return "; ".join(m.strip() for m in messages)[:1000] or "invalid grammar"
    return _lexer_probe(grammar)


LEXER_PROBE_BYTES = 8  # bytes walked from each first byte
LEXER_PROBE_BRANCHES = 16  # first bytes tried (spread over those the grammar allows)


class _ByteTokenizer:
    """A tokenizer of single bytes (and an EOS) for llguidance: enough to run a grammar's first
    steps without the model's tokenizer (`_lexer_probe`)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode("utf-8"))


@functools.cache
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def _allowed_bytes(matcher: Any) -> list[int]:
    mask = int.from_bytes(matcher.compute_bitmask()[:32], "little")  # bytes 0-255
    return [b for b in range(256) if mask >> b & 1]


def _lexer_probe(grammar: str) -> str | None:
    """llguidance builds its lexer lazily, so a grammar that validates can still exceed the
    lexer's limits at the first bytes it reads (`a{1000000}`: "too many expressions
    constructed"), which surfaced as a failed request mid-answer. From up to
    `LEXER_PROBE_BRANCHES` of the first bytes it allows, walk `LEXER_PROBE_BYTES` bytes (the
    lowest allowed each step) and report such an error. A heuristic: a limit reached only
    deeper, or down another branch, still fails the request in the worker."""
    import llguidance

    root = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    first = _allowed_bytes(root)  # llguidance answers an empty mask once in error
    if root.is_error():  # at its start, or computing the first mask
        return _too_large(root)
    step = max(1, len(first) // LEXER_PROBE_BRANCHES)
    for byte in first[::step][:LEXER_PROBE_BRANCHES]:
        matcher = root.deep_copy()
        matcher.consume_token(byte)
        for _ in range(LEXER_PROBE_BYTES - 1):
            allowed = _allowed_bytes(matcher)
            if matcher.is_error() or not allowed:
                break
            matcher.consume_token(allowed[0])
        if matcher.is_error():
            return _too_large(matcher)
    return None


def _too_large(matcher: Any) -> str:
    return f"the grammar is too large to enforce: {matcher.get_error().splitlines()[0][:500]}"
