"""API-key check (ASGI middleware) and the request-body size limit.

The key is compared in constant time: both sides are hashed with SHA-256 first, so
``hmac.compare_digest`` sees equal-length inputs and the comparison time does not depend on
where a guess first differs, nor on the key's length. Every path except ``/health`` and
``/ready`` (probes; laneserve.api.health) needs the key -- unknown paths too (a 401, not a 404, so routes cannot be enumerated without it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from starlette.requests import Request

from laneserve.api.errors import ApiError, error_response, invalid
from laneserve.contracts.openai.checks import unpaired_surrogate

OPEN_PATHS = frozenset({"/health", "/ready"})


class ApiKeyMiddleware:
    """Refuse HTTP requests without ``Authorization: Bearer <api_key>`` (401)."""

    def __init__(self, app: Any, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = b""
        for name, v in headers:
            if name == b"authorization":
                value = v
                break
        scheme, _, token = value.strip().partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        ok_token = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)
        return ok_scheme & ok_token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.allowed(scope["headers"]):
            response = error_response(
                "unauthorized", "missing or invalid API key (Authorization: Bearer <key>)"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes. Raises ApiError ``payload_too_large`` (413)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise invalid("invalid Content-Length header") from None
        if size > limit:
            raise ApiError("payload_too_large", f"request body over {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError("payload_too_large", f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> Any:
    """The body parsed as JSON. Raises ApiError: 413 over ``limit``, 400 when not JSON or when
    a string in it is not valid Unicode (`unpaired_surrogate`)."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    where = unpaired_surrogate(body)
    if where is not None:
        raise invalid(f"the request body is not valid Unicode: {where} holds an unpaired "
                      "UTF-16 surrogate (a lone \\ud800-\\udfff escape)")  # fmt: skip
    return body
