"""Arrival of an HTTP request: stamped the moment the gateway's ASGI app is called.

DESIGN.md "Per-phase latency": arrival is when the edge accepted the request, before body
parsing and tokenization. :class:`ArrivalMiddleware` is the outermost middleware, so the stamp
is taken as soon as uvicorn has parsed the request line and headers -- before the API-key check,
the body read, validation and prompt counting, which all count towards TTFT and e2e.
"""

from __future__ import annotations

import time
from typing import Any

SCOPE_KEY = "laneserve.arrival"  # (time.monotonic() s, time.time() s) in the ASGI scope


class ArrivalMiddleware:
    """Pure ASGI middleware that writes :data:`SCOPE_KEY` into every HTTP scope."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[SCOPE_KEY] = (time.monotonic(), time.time())
        await self.app(scope, receive, send)


def arrival(scope: dict) -> tuple[float, float]:
    """``(monotonic s, unix s)`` of the request's arrival (now, if no middleware stamped it)."""
    stamp = scope.get(SCOPE_KEY)
    return stamp if stamp is not None else (time.monotonic(), time.time())
