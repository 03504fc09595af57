"""Errors at the HTTP edge: one exception type, OpenAI's error JSON, DESIGN.md's status codes.

Body shape (OpenAI API)::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_request"}}

``code`` is laneserve's error code (DESIGN.md "Error codes", ``broker.protocol.ERROR_CODES``);
``type`` is OpenAI's error class for that status.
"""

from __future__ import annotations

import json

from starlette.responses import Response

# DESIGN.md "Error codes" (+ the broker's extra codes).
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
    "client_too_slow": 503,
    "deadline_exceeded": 504,
}

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

RETRY_AFTER_S = 1  # Retry-After for 429 / 503


class ApiError(Exception):
    """A request that ends with an error response.

    ``code``: a key of :data:`STATUS_BY_CODE`; ``param``: the offending body field, if any.
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

    def response(self) -> Response:
        return error_response(self.code, self.message, self.param, status=self.status)


def invalid(message: str, param: str | None = None) -> ApiError:
    """Shorthand for a 400 ``invalid_request``."""
    return ApiError("invalid_request", message, param=param)


def error_body(
    code: str, message: str, param: str | None = None, status: int | None = None
) -> dict:
    status = status or STATUS_BY_CODE.get(code, 500)
    return {
        "error": {
            "message": message,
            "type": _TYPE_BY_STATUS.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    code: str, message: str, param: str | None = None, *, status: int | None = None
) -> Response:
    """A JSON error response with ``status`` or the status for ``code`` (unknown -> 500)."""
    status = status or STATUS_BY_CODE.get(code, 500)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return Response(
        json.dumps(error_body(code, message, param, status)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
