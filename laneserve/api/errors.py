"""Errors at the HTTP edge: :class:`laneserve.contracts.openai.errors.OpenAIError` as a JSON response.

The error objects, codes and statuses live in :mod:`laneserve.contracts.openai.errors` (shared with
bulk-job lines); this module adds the HTTP response and ``Retry-After`` (DESIGN.md "Error codes":
429 and 503 carry one).
"""

from __future__ import annotations

import json

from starlette.responses import Response

from laneserve.contracts.openai.errors import STATUS_BY_CODE, error_body, invalid
from laneserve.contracts.openai.errors import OpenAIError as ApiError

RETRY_AFTER_S = 1  # Retry-After for 429 / 503

__all__ = ["ApiError", "STATUS_BY_CODE", "error_response", "invalid", "response_for"]


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


def response_for(error: ApiError) -> Response:
    """The HTTP response of an :class:`ApiError`."""
    return error_response(error.code, error.message, error.param, status=error.status)
