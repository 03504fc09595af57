"""Errors raised by the jobs package, each with the DESIGN.md error `code` and HTTP status.

The HTTP gateway turns them into OpenAI-shaped error responses (`{"error": {"code",
"message"}}` with `status_code`); the CLI prints the message.
"""

from __future__ import annotations


class JobsError(Exception):
    """Base class. `code` is a DESIGN.md "Error codes" value, `status_code` its HTTP status,
    `param` the request field at fault where one is (the OpenAI error object's `param`, e.g.
    "task_options.max_tokens"), else None."""

    code = "internal"
    status_code = 500

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequestError(JobsError, ValueError):
    """Bad input from the caller: unknown endpoint, bad completion window, wrong file purpose,
    a file that is not a batch input, an unknown task. HTTP 400."""

    code = "invalid_request"
    status_code = 400


class NotFoundError(JobsError, LookupError):
    """No batch or file with that id. HTTP 404."""

    code = "not_found"
    status_code = 404


class PayloadTooLargeError(InvalidRequestError):
    """An uploaded file over the size limit (`jobs.limits.MAX_FILE_BYTES`). HTTP 413."""

    code = "payload_too_large"
    status_code = 413


class ConflictError(InvalidRequestError):
    """The operation does not apply in the batch's current status (e.g. cancelling a completed
    batch). HTTP 409."""

    code = "invalid_request"
    status_code = 409


def error_text(err: dict) -> str:
    """One of a job's errors (OpenAI's batch `errors.data` item) for a person: its input line
    first where it names one, then its code and message (`line 3: invalid_json: not JSON`)."""
    where = f"line {err['line']}: " if isinstance(err.get("line"), int) else ""
    return f"{where}{err.get('code')}: {err.get('message')}"
