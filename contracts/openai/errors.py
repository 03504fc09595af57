"""Error objects of the OpenAI surface: one exception type, OpenAI's error JSON, DESIGN.md's codes.

Body shape (OpenAI API)::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_request"}}

``code`` is laneserve's error code (DESIGN.md "Error codes"; the broker's ``ERROR_CODES`` plus the
HTTP-only ones); ``type`` is OpenAI's error class for that status. The gateway answers an
:class:`OpenAIError` with ``status`` and :meth:`OpenAIError.body`; a bulk-job line that fails the
same check gets ``{"code", "message"}`` of the same error in its error-file line.
"""

from __future__ import annotations

from collections.abc import Iterable

# DESIGN.md "Error codes" (+ the broker's extra codes) -> HTTP status.
STATUS_BY_CODE: dict[str, int] = {
    "invalid_request": 400,
    "prompt_too_long": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "payload_too_large": 413,
    "overloaded": 429,
    "internal": 500,
    "engine_error": 500,
    "no_worker": 503,
    "worker_lost": 503,
    "database_unavailable": 503,  # the SQL database is unreachable: retry after Retry-After
    "insufficient_storage": 507,  # the disk under the database or the files is full
    "deadline_exceeded": 504,
}

TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    507: "server_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    """A request that ends with an error.

    ``code``: a key of :data:`STATUS_BY_CODE`; ``param``: the offending body field, if any;
    ``status``: the HTTP status (default: the code's).
    """

    def __init__(
        self, code: str, message: str, *, param: str | None = None, status: int | None = None
    ) -> None:
        assert code in STATUS_BY_CODE, f"unknown error code {code!r}"
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status or STATUS_BY_CODE[code]

    def body(self) -> dict:
        """The OpenAI error object ``{"error": {...}}``."""
        return error_body(self.code, self.message, self.param, self.status)

    def line_error(self) -> dict[str, str]:
        """The ``error`` of a bulk-job error-file line: ``{"code", "message"}``."""
        return {"code": self.code, "message": self.message}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """Shorthand for a 400 ``invalid_request``."""
    return OpenAIError("invalid_request", message, param=param)


def model_not_found(model: str, served: Iterable[str] = ()) -> OpenAIError:
    """404 ``not_found`` for a model nobody serves, naming the ``served`` ones (GET /v1/models
    lists them)."""
    names = ", ".join(f"'{name}'" for name in served if name)
    also = f"; this server serves {names}" if names else ""
    return OpenAIError("not_found", f"the model '{model}' does not exist{also}", param="model")


def error_body(
    code: str, message: str, param: str | None = None, status: int | None = None
) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` (unknown codes: a 500's type)."""
    status = status or STATUS_BY_CODE.get(code, 500)
    return {
        "error": {
            "message": message,
            "type": TYPE_BY_STATUS.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }
