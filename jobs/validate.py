"""Validation of a batch input file, line by line, before any inference.

Two input forms (DESIGN.md "Bulk jobs"):

- OpenAI Batch JSONL: `{"custom_id", "method": "POST", "url", "body"}` per line, `url` one of
  `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` (a file may mix them: each line
  runs as its own `url` would);
- the task shorthand (`task` = "summarize" | "translate"): `{"id", "text"}` per line.

`Validator.lines(path)` streams the file and yields one `LineResult` per non-blank line, good or
bad. Line-level problems (not JSON, not an object, a missing or wrong field, a prompt longer
than `max_model_len`) are `LineResult.error` entries named by the line's `custom_id`, or
`line-N` (1-based line number) when it has none. Job-level problems raise `JobValidationError`
with OpenAI-shaped `errors` (`[{"code", "message", "line"}]`): a file over the size or line
limit, more than one model, and (after the whole file is read, with the other lines' first
errors beside them) every duplicate `custom_id`, each naming both line numbers. The caller
fails the job when more than half the lines are bad (`Validator.too_many_bad`).

A line's `body` is checked by the gateway's own code (`contracts.openai`): the same parser, the
same model-name check (unknown model -> `not_found`), the same prompt counting and `max_tokens`
rules, so a body is accepted in a batch exactly when `POST {url}` would accept it, with the same
error message otherwise. Two things a batch line cannot do, each refused with its own message:
stream (`stream: true`) and leave the batch lane (`lane: "interactive"`); `n > 1` and several
prompts fan out as in the API (`jobs.results.choice_requests`). The validated wire
`sampling_params` are stored with the line, so the runner submits exactly what was validated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laneserve.contracts.openai import Limits, OpenAIError, ParsedRequest, ServedModel, parse
from laneserve.contracts.openai.checks import unpaired_surrogate
from laneserve.jobs import prompts
from laneserve.jobs.errors import InvalidRequestError
from laneserve.jobs.limits import (
    ENDPOINTS,
    MAX_BAD_FRACTION,
    MAX_CUSTOM_ID_CHARS,
    MAX_FILE_BYTES,
    MAX_JOB_ERRORS,
    MAX_LINES,
)


class LineError(ValueError):
    """A bad line: `code` (DESIGN.md error code), message, and `param` (the line's field at
    fault, as the OpenAI error object names it, e.g. "body.max_tokens") where one is known."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class JobValidationError(ValueError):
    """The whole job fails at validation; `errors` is `[{"code", "message", "line"}]` (+
    `"param"` where a field is at fault)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(e["message"] for e in errors))
        self.errors = errors


@dataclass(slots=True)
class LineResult:
    """One validated line. Exactly one of `request` and `error` is set.

    `request` is what the runner sends: `{"url", "body", "sampling_params"}` (the OpenAI
    request body, normalized, and its validated wire sampling params, `max_tokens` settled),
    plus `"prompt_token_ids"` (one list per prompt) when the validator tokenized them, or
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
    """Validates the lines of one job. `counter` is the served model (names, tokenizer, context
    length; None: no model-name or length checks). `task_options` holds `target_lang`, `source_lang`, `max_tokens`, `schema` (strings)
    for task jobs; `default_model` fills lines without a model."""

    endpoint: str
    counter: ServedModel | None
    task: str | None = None
    task_options: dict[str, str] = field(default_factory=dict)
    default_model: str | None = None
    max_lines: int = MAX_LINES
    max_bytes: int = MAX_FILE_BYTES
    limits: Limits = field(default_factory=Limits)
    num_lines: int = 0
    num_bad: int = 0
    models: set[str] = field(default_factory=set)
    first_errors: list[dict[str, Any]] = field(default_factory=list)
    _seen: dict[str, int] = field(default_factory=dict)
    _duplicates: list[dict[str, Any]] = field(default_factory=list)

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
        try:
            prompts.check_task_options(self.task, self.task_options)
        except InvalidRequestError as exc:
            error = {"code": "invalid_request", "message": str(exc), "param": exc.param}
            raise JobValidationError([{**error, "line": None}]) from None
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
                if self._is_duplicate(result):
                    continue  # not yielded: the job fails below, with every other error
                if result.error is not None:
                    self.num_bad += 1
                    if len(self.first_errors) < MAX_JOB_ERRORS:
                        self.first_errors.append({**result.error, "line": line_no})
                yield result
        if self._duplicates:
            room = max(MAX_JOB_ERRORS - len(self._duplicates), 0)
            errors = [*self._duplicates, *self.first_errors[:room]]  # the duplicates kept first
            raise JobValidationError(sorted(errors, key=lambda e: e["line"]))  # in file order

    # ------------------------------------------------------------------ internals

    def _is_duplicate(self, result: LineResult) -> bool:
        """Whether `result` repeats an earlier line's custom_id (the first `MAX_JOB_ERRORS`
        repeats are kept as job errors, each naming both lines; the file is read to its end so
        the job's errors also hold the other lines' problems)."""
        first = self._seen.get(result.custom_id)
        if first is None:
            self._seen[result.custom_id] = result.line_no
            return False
        if len(self._duplicates) < MAX_JOB_ERRORS:
            field = "id" if self.task is not None else "custom_id"  # the user's own field name
            msg = f"duplicate {field} {result.custom_id!r} on lines {first} and {result.line_no}"
            named = [n for n in (first, result.line_no) if result.custom_id == f"line-{n}"]
            if named:  # one of them had no usable id: it is named after its line (DESIGN.md)
                msg += (f" (line {named[0]} has no usable {field} and is named after its line; "
                        f"give it its own {field})")  # fmt: skip
            self._duplicates.append(
                {"code": "duplicate_custom_id", "message": msg, "param": field,
                 "line": result.line_no}
            )  # fmt: skip
        return True

    def _line(self, line_no: int, raw: bytes) -> LineResult:
        name = f"line-{line_no}"
        if line_no == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
        try:
            # without its line break: a line cut short would otherwise fail at "line 2 column 1"
            obj = json.loads(raw.rstrip(b"\r\n"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            # the decoder's "line 1 column 5" would read as the file's line: name the column only
            why = (
                f"{exc.msg.removesuffix(' at')} at column {exc.colno}"  # "starting at" + "at"
                if isinstance(exc, json.JSONDecodeError)
                else exc
            )
            return LineResult(line_no, name, error=_err("invalid_json", f"not JSON: {why}"))
        if not isinstance(obj, dict):
            msg = f"line is a JSON {type(obj).__name__}, not an object"
            return LineResult(line_no, name, error=_err("invalid_request", msg))
        where = unpaired_surrogate(obj)  # no UTF-8 form: the tokenizer and database refuse it
        try:
            if where not in ("custom_id", "id"):  # the line keeps its name if that is valid
                name = self._custom_id(obj, line_no)
        except LineError as exc:
            if where is None:
                return LineResult(line_no, name, error=_err(exc.code, str(exc), exc.param))
        if where is not None:
            msg = f"not valid Unicode: {where} holds an unpaired UTF-16 surrogate escape"
            param = where.removeprefix("an object key of ")
            return LineResult(line_no, name, error=_err("invalid_json", msg, param))
        try:
            if self.task is not None:
                request, tokens = self._task_line(obj)
            else:
                request, tokens = self._openai_line(obj)
        except LineError as exc:
            return LineResult(line_no, name, error=_err(exc.code, str(exc), exc.param))
        return LineResult(line_no, name, request=request, prompt_tokens=tokens)

    def _custom_id(self, obj: dict, line_no: int) -> str:
        key = "id" if self.task is not None else "custom_id"
        value = obj.get(key)
        if value is None:
            return f"line-{line_no}"
        if self.task is not None and type(value) is int:
            value = str(value)
        if not isinstance(value, str) or not value:
            raise LineError("invalid_request", f"{key} must be a non-empty string", param=key)
        if len(value) > MAX_CUSTOM_ID_CHARS:
            msg = f"{key} is longer than {MAX_CUSTOM_ID_CHARS} characters"
            raise LineError("invalid_request", msg, param=key)
        return value

    def _openai_line(self, obj: dict) -> tuple[dict, int | None]:
        missing = [k for k in ("custom_id", "method", "url", "body") if k not in obj]
        if missing:
            raise LineError("invalid_request", f"missing field(s) {missing}", param=missing[0])
        if obj["method"] != "POST":
            msg = f"method must be POST, got {obj['method']!r}"
            raise LineError("invalid_request", msg, param="method")
        url = obj["url"]
        if url not in ENDPOINTS:  # a line may name another endpoint than the batch's own
            msg = f"url {str(url)[:80]!r} is not an endpoint batches take ({', '.join(ENDPOINTS)})"
            raise LineError("invalid_request", msg, param="url")
        body = obj["body"]
        if not isinstance(body, dict):
            raise LineError("invalid_request", "body must be an object", param="body")
        return self._request(body, url=url)

    def _task_line(self, obj: dict) -> tuple[dict, int | None]:
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            if text is None:
                what = "missing"
            elif isinstance(text, str):
                what = "empty"
            else:
                what = f"a JSON {type(text).__name__}, not a string"
            msg = f"field 'text' is {what} (a non-empty string)"
            raise LineError("invalid_request", msg, param="text")
        body = prompts.task_body(self.task, text, self.default_model, self.task_options)
        if self.task == "summarize" and self.counter is not None:
            req = self._parse(body)
            req.prompts[0].encoded = self.counter.encode(req.prompts[0])  # check() reuses them
            tokens = self.counter.count(req.prompts[0])
            limit = self.max_model_len
            if tokens is not None and limit is not None and tokens + req.max_tokens > limit:
                sampling = {**req.sampling, "max_tokens": req.max_tokens}
                request = {"url": self.endpoint, "body": req_body(req, body)}
                request.update(sampling_params=sampling, map_reduce={"text": text})
                return request, tokens
            return self._request(body, req)
        return self._request(body)

    def _request(
        self, body: dict, req: ParsedRequest | None = None, url: str | None = None
    ) -> tuple[dict, int | None]:
        """Validate `body` (already parsed: `req`) as the gateway would; the stored request and
        its prompt tokens."""
        url = url or self.endpoint
        req = req or self._parse(body, url)
        try:
            (self.counter or ServedModel()).check(req, self.limits)
        except OpenAIError as exc:
            raise LineError(exc.code, exc.message, param=self._param(exc.param)) from exc
        stored = body if url == "/v1/responses" else req_body(req, body)  # parsed again as is
        request = {"url": url, "body": {**stored, "model": req.model}}
        request["sampling_params"] = req.sampling
        encoded = [p.encoded for p in req.prompts]
        if None not in encoded:  # tokenized once here (tools rendered): the engine takes these
            request["prompt_token_ids"] = encoded
        counts = [p.num_tokens for p in req.prompts]
        return request, None if None in counts else sum(counts)

    def _parse(self, body: dict, url: str | None = None) -> ParsedRequest:
        """`contracts.openai.parse` + the model checks + what a batch line cannot do."""
        default = self.default_model or (self.counter and self.counter.served_name)
        if body.get("model") is None and default:
            body = {**body, "model": default}
        try:
            req = parse(url or self.endpoint, body, self.limits)
            if self.counter is not None:  # an unknown model is this line's error, not the job's
                self.counter.check_name(req.model)
            self._note_model(req.model)
        except OpenAIError as exc:
            raise LineError(exc.code, exc.message, param=self._param(exc.param)) from exc
        if req.stream:
            raise LineError(
                "invalid_request", "stream must be false in a batch", param="body.stream"
            )
        if body.get("lane") not in (None, "batch") or body.get("priority") == "interactive":
            param = "body.lane" if body.get("lane") not in (None, "batch") else "body.priority"
            raise LineError("invalid_request", "a batch line runs in the batch lane", param=param)
        return req

    def _param(self, param: str | None) -> str | None:
        """A request body's field at fault as the user wrote it: "body.max_tokens" on an OpenAI
        batch line; on a task line the field the body was built from ("text", a task option)."""
        if param is None or self.task is None:
            return None if param is None else f"body.{param}"
        root = param.split(".", 1)[0].split("[", 1)[0]
        return _TASK_PARAMS.get(root)

    def _note_model(self, model: str) -> None:
        if model not in self.models:
            self.models.add(model)
            if len(self.models) > 1:
                msg = f"more than one model in one batch: {sorted(self.models)}"
                raise JobValidationError(
                    [{"code": "multiple_models", "message": msg, "line": None}]
                )


# A task line's body field -> what the user wrote it as (`prompts.task_body` builds the body).
_TASK_PARAMS = {
    "messages": "text",
    "max_tokens": "task_options.max_tokens",
    "response_format": "task_options.schema",
}


def req_body(req: ParsedRequest, body: dict) -> dict:
    """The stored body: `body` with its model filled in and its prompt normalized (chat text
    parts joined, `developer` -> `system`; completion prompts as strings or token ids, a list
    of them when there are several; an embeddings body's `input` likewise)."""
    out = {**body, "model": req.model}
    if req.kind == "chat":
        out["messages"] = req.prompts[0].messages
        return out
    forms = [p.text if p.text is not None else p.token_ids for p in req.prompts]
    out["input" if req.kind == "embedding" else "prompt"] = forms[0] if len(forms) == 1 else forms
    return out


def _err(code: str, message: str, param: str | None = None) -> dict[str, str]:
    """A bad line's error object: code and message, and the field at fault where known."""
    error = {"code": code, "message": message}
    if param is not None:
        error["param"] = param
    return error
