"""Validation of a batch input file, line by line, before any inference.

Two input forms (DESIGN.md "Bulk jobs"):

- OpenAI Batch JSONL: `{"custom_id", "method": "POST", "url", "body"}` per line, `url` equal to
  the batch's endpoint (`/v1/chat/completions` or `/v1/completions`);
- the task shorthand (`task` = "summarize" | "translate"): `{"id", "text"}` per line.

`Validator.lines(path)` streams the file and yields one `LineResult` per non-blank line, good or
bad. Line-level problems (not JSON, not an object, a missing or wrong field, a prompt longer
than `max_model_len`) are `LineResult.error` entries named by the line's `custom_id`, or
`line-N` (1-based line number) when it has none. Job-level problems raise `JobValidationError`
with OpenAI-shaped `errors` (`[{"code", "message", "line"}]`): a file over the size or line
limit, a duplicate `custom_id` (naming both line numbers), more than one model. The caller
fails the job when more than half the lines are bad (`Validator.too_many_bad`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs import prompts
from jobs.limits import (
    MAX_BAD_FRACTION,
    MAX_CUSTOM_ID_CHARS,
    MAX_FILE_BYTES,
    MAX_JOB_ERRORS,
    MAX_LINES,
)
from jobs.tokens import PromptCounter

# Body fields accepted per endpoint; anything else is named in a line error.
COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "n",
        "stream",
        "user",
        "metadata",
        "store",
    }
)
CHAT_FIELDS = COMMON_FIELDS | {"messages"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
INT_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "top_k", "min_tokens")


class LineError(ValueError):
    """A bad line: `code` (DESIGN.md error code) and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class JobValidationError(ValueError):
    """The whole job fails at validation; `errors` is `[{"code", "message", "line"}]`."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(e["message"] for e in errors))
        self.errors = errors


@dataclass(slots=True)
class LineResult:
    """One validated line. Exactly one of `request` and `error` is set.

    `request` is what the runner sends: `{"url", "body"}` with the OpenAI request body, plus
    `"map_reduce": {"text"}` for a summarize document longer than the context. `error` is
    `{"code", "message"}`. `prompt_tokens` is the counted prompt length (tokens) when known.
    """

    line_no: int
    custom_id: str
    request: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    prompt_tokens: int | None = None


@dataclass
class Validator:
    """Validates the lines of one job. `task_options` holds `target_lang`, `source_lang`,
    `max_tokens` (strings) for task jobs; `default_model` fills lines without a model."""

    endpoint: str
    counter: PromptCounter | None
    task: str | None = None
    task_options: dict[str, str] = field(default_factory=dict)
    default_model: str | None = None
    max_lines: int = MAX_LINES
    max_bytes: int = MAX_FILE_BYTES
    num_lines: int = 0
    num_bad: int = 0
    models: set[str] = field(default_factory=set)
    first_errors: list[dict[str, Any]] = field(default_factory=list)
    _seen: dict[str, int] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int | None:
        return None if self.counter is None else self.counter.max_model_len

    @property
    def model(self) -> str | None:
        return next(iter(self.models), None) or self.default_model

    def too_many_bad(self) -> bool:
        """More than `MAX_BAD_FRACTION` of the lines are bad (or the file has no line)."""
        return self.num_lines == 0 or self.num_bad > self.num_lines * MAX_BAD_FRACTION

    def job_errors(self) -> list[dict[str, Any]]:
        """errors[] for a job failed for too many bad lines: a summary + the first few."""
        summary = {
            "code": "too_many_failed_lines",
            "message": f"{self.num_bad} of {self.num_lines} lines are invalid",
            "line": None,
        }
        if self.num_lines == 0:
            summary = {"code": "empty_file", "message": "the input file has no lines", "line": None}
        return [summary, *self.first_errors]

    def lines(self, path: Path) -> Iterator[LineResult]:
        """Validate `path` line by line (streamed; memory holds the custom_id set only).

        Raises:
            JobValidationError: size/line limits, duplicate custom_id, more than one model.
        """
        if self.task == "translate" and not self.task_options.get("target_lang"):
            raise JobValidationError(
                [
                    {
                        "code": "invalid_request",
                        "message": "translate needs target_lang",
                        "line": None,
                    }
                ]
            )
        size = path.stat().st_size
        if size > self.max_bytes:
            msg = f"input file is {size} bytes; the limit is {self.max_bytes}"
            raise JobValidationError([{"code": "file_too_large", "message": msg, "line": None}])
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                self.num_lines += 1
                if self.num_lines > self.max_lines:
                    msg = f"input file has more than {self.max_lines} lines"
                    raise JobValidationError(
                        [{"code": "too_many_lines", "message": msg, "line": line_no}]
                    )
                result = self._line(line_no, raw)
                self._check_duplicate(result)
                if result.error is not None:
                    self.num_bad += 1
                    if len(self.first_errors) < MAX_JOB_ERRORS:
                        self.first_errors.append({**result.error, "line": line_no})
                yield result

    # ------------------------------------------------------------------ internals

    def _check_duplicate(self, result: LineResult) -> None:
        first = self._seen.get(result.custom_id)
        if first is not None:
            msg = f"duplicate custom_id {result.custom_id!r} on lines {first} and {result.line_no}"
            raise JobValidationError(
                [{"code": "duplicate_custom_id", "message": msg, "line": result.line_no}]
            )
        self._seen[result.custom_id] = result.line_no

    def _line(self, line_no: int, raw: bytes) -> LineResult:
        name = f"line-{line_no}"
        if line_no == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return LineResult(line_no, name, error=_err("invalid_json", f"not JSON: {exc}"))
        if not isinstance(obj, dict):
            msg = f"line is a JSON {type(obj).__name__}, not an object"
            return LineResult(line_no, name, error=_err("invalid_request", msg))
        try:
            name = self._custom_id(obj, line_no)
        except LineError as exc:
            return LineResult(line_no, name, error=_err(exc.code, str(exc)))
        try:
            if self.task is not None:
                request, tokens = self._task_line(obj)
            else:
                request, tokens = self._openai_line(obj)
        except LineError as exc:
            return LineResult(line_no, name, error=_err(exc.code, str(exc)))
        return LineResult(line_no, name, request=request, prompt_tokens=tokens)

    def _custom_id(self, obj: dict, line_no: int) -> str:
        key = "id" if self.task is not None else "custom_id"
        value = obj.get(key)
        if value is None:
            return f"line-{line_no}"
        if self.task is not None and type(value) is int:
            value = str(value)
        if not isinstance(value, str) or not value:
            raise LineError("invalid_request", f"{key} must be a non-empty string")
        if len(value) > MAX_CUSTOM_ID_CHARS:
            raise LineError(
                "invalid_request", f"{key} is longer than {MAX_CUSTOM_ID_CHARS} characters"
            )
        return value

    def _openai_line(self, obj: dict) -> tuple[dict, int | None]:
        missing = [k for k in ("custom_id", "method", "url", "body") if k not in obj]
        if missing:
            raise LineError("invalid_request", f"missing field(s) {missing}")
        if obj["method"] != "POST":
            raise LineError("invalid_request", f"method must be POST, got {obj['method']!r}")
        if obj["url"] != self.endpoint:
            raise LineError(
                "invalid_request", f"url {obj['url']!r} is not the batch endpoint {self.endpoint}"
            )
        body = obj["body"]
        if not isinstance(body, dict):
            raise LineError("invalid_request", "body must be an object")
        body = self._check_body(body)
        if self.endpoint == "/v1/chat/completions":
            tokens = self._count(lambda c: c.count_chat(body["messages"]))
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list):
                tokens = len(prompt)
            else:
                tokens = self._count(lambda c: c.count_text(prompt))
        self._check_length(tokens, body)
        return {"url": self.endpoint, "body": body}, tokens

    def _task_line(self, obj: dict) -> tuple[dict, int | None]:
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise LineError("invalid_request", "missing field 'text' (a non-empty string)")
        body = prompts.task_body(self.task, text, self.default_model, self.task_options)
        self._note_model(body)
        tokens = self._count(lambda c: c.count_chat(body["messages"]))
        request = {"url": self.endpoint, "body": body}
        if self.task == "summarize" and tokens is not None:
            if tokens + body["max_tokens"] > self.max_model_len:
                request["map_reduce"] = {"text": text}
                return request, tokens
        self._check_length(tokens, body)
        return request, tokens

    def _check_body(self, body: dict) -> dict:
        allowed = CHAT_FIELDS if self.endpoint == "/v1/chat/completions" else COMPLETION_FIELDS
        unsupported = sorted(set(body) - allowed)
        if unsupported:
            raise LineError("invalid_request", f"unsupported field(s) {unsupported}")
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            raise LineError("invalid_request", "only n = 1 is supported")
        if body.get("stream"):
            raise LineError("invalid_request", "stream must be false in a batch")
        if body.get("echo") or body.get("suffix"):
            raise LineError("invalid_request", "echo and suffix are not supported")
        for key in NUMBER_FIELDS:
            value = body.get(key)
            if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
                raise LineError("invalid_request", f"{key} must be a number")
        for key in INT_FIELDS:
            value = body.get(key)
            if value is not None and (type(value) is not int or value < 0):
                raise LineError("invalid_request", f"{key} must be a non-negative integer")
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) == 0:
                raise LineError("invalid_request", f"{key} must be at least 1")
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise LineError("invalid_request", "stop must be a string or a list of strings")
        if self.endpoint == "/v1/chat/completions":
            body = {**body, "messages": _check_messages(body.get("messages"))}
        else:
            body = {**body, "prompt": _check_prompt(body.get("prompt"))}
        self._note_model(body)
        return body

    def _note_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            if self.default_model is not None:
                body["model"] = self.default_model
            return
        if not isinstance(model, str) or not model:
            raise LineError("invalid_request", "model must be a non-empty string")
        if model not in self.models:
            self.models.add(model)
            if len(self.models) > 1:
                msg = f"more than one model in one batch: {sorted(self.models)}"
                raise JobValidationError(
                    [{"code": "multiple_models", "message": msg, "line": None}]
                )

    def _count(self, fn) -> int | None:
        if self.counter is None:
            return None
        return fn(self.counter)

    def _check_length(self, tokens: int | None, body: dict) -> None:
        limit = self.max_model_len
        if tokens is None or limit is None:
            return
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 1
        if tokens + max_tokens > limit:
            raise LineError(
                "prompt_too_long",
                f"prompt is {tokens} tokens; with max_tokens {max_tokens} it exceeds "
                f"max_model_len {limit}",
            )


def _err(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def _check_messages(messages: Any) -> list[dict]:
    """Chat messages with string content (text parts joined). Raises LineError."""
    if not isinstance(messages, list) or not messages:
        raise LineError("invalid_request", "messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise LineError("invalid_request", f"messages[{i}] must be an object with a role")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise LineError("invalid_request", f"messages[{i}]: only text parts supported")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise LineError("invalid_request", f"messages[{i}].content must be a string")
        out.append({"role": msg["role"], "content": content})
    return out


def _check_prompt(prompt: Any) -> str | list[int]:
    """A completion prompt: a string or a list of token ids (a list of one of them).

    Raises:
        LineError: anything else (several prompts: use one line per prompt).
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    raise LineError(
        "invalid_request", "prompt must be one non-empty string or one list of token ids"
    )
