"""Liveness and readiness of the gateway (DESIGN.md "Health").

``GET /health`` is liveness: the process answers, always 200, and never waits on the broker.
``GET /ready`` is readiness (canonical; ``GET /health?ready=1`` is the same answer for probes
that can only be given one path): 200 when the broker answers a status call and every lane in
``lanes`` has at least one live, non-draining worker; 503 otherwise, with the reasons::

    {"ready": false, "reasons": ["no worker serves the batch lane"],
     "broker": true, "workers": 1, "lanes": {"interactive": 1, "batch": 0}, "age_s": 0.4}

The gateway adds ``"database"`` to the body (:func:`laneserve.api.probes.ready`): whether the
files/batches database answered its last check; it does not change ``ready``.

The answer is cached for ``ttl_s`` seconds (a status call per probe would hammer the broker with
several probers), and concurrent probes share one status call. :func:`fetch_readiness` is the
blocking client ``laneserve up`` waits with. This module imports neither FastAPI nor torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from laneserve.contracts.openai.requests import LANES

logger = logging.getLogger(__name__)

DEFAULT_READY_TTL_S = 1.0  # seconds a readiness answer is reused


@dataclass(frozen=True, slots=True)
class Readiness:
    """One readiness answer.

    ``broker``: the broker answered the status call. ``workers``: live, non-draining workers.
    ``lanes``: such workers per required lane. ``reasons``: empty when ready.
    ``checked_at``: ``time.monotonic()`` of the status call (s).
    """

    ready: bool
    reasons: list[str]
    broker: bool
    workers: int
    lanes: dict[str, int] = field(default_factory=dict)
    checked_at: float = 0.0

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """The HTTP body; ``age_s`` is how old the answer is (s)."""
        now = time.monotonic() if now is None else now
        return {
            "ready": self.ready,
            "reasons": list(self.reasons),
            "broker": self.broker,
            "workers": self.workers,
            "lanes": dict(self.lanes),
            "age_s": round(max(0.0, now - self.checked_at), 3),
        }


def assess(
    status: dict[str, Any] | None, lanes: Sequence[str] = LANES, checked_at: float = 0.0
) -> Readiness:
    """Readiness from a broker status (``{"workers": [...], ...}``; None: no answer)."""
    if status is None:
        return Readiness(False, ["the broker does not answer"], False, 0, {}, checked_at)
    live = [w for w in status.get("workers") or [] if not w.get("draining")]
    per_lane = {lane: sum(lane in (w.get("lanes") or []) for w in live) for lane in lanes}
    reasons = [f"no worker serves the {lane} lane" for lane, n in per_lane.items() if n == 0]
    if not live:
        reasons.insert(0, "no worker is attached to the broker")
    return Readiness(not reasons, reasons, True, len(live), per_lane, checked_at)


class ReadinessProbe:
    """Cached readiness: ``refresh`` asks the broker (returns its status dict or None when it
    does not answer); answers younger than ``ttl_s`` seconds are reused."""

    def __init__(
        self,
        refresh: Callable[[], Awaitable[dict[str, Any] | None]],
        lanes: Sequence[str] = LANES,
        ttl_s: float = DEFAULT_READY_TTL_S,
    ) -> None:
        unknown = [lane for lane in lanes if lane not in LANES]
        if unknown or not lanes:
            raise ValueError(f"readiness lanes must be a non-empty subset of {LANES}: {lanes}")
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self._refresh = refresh
        self.lanes = tuple(lanes)
        self.ttl_s = ttl_s
        self._last: Readiness | None = None
        self._lock = asyncio.Lock()

    def observe(self, status: dict[str, Any] | None, at: float) -> None:
        """Record a status the gateway fetched anyway (its poller), at monotonic ``at`` (s)."""
        self._last = assess(status, self.lanes, at)

    async def check(self) -> Readiness:
        """The readiness answer, at most ``ttl_s`` old."""
        last = self._last
        if last is not None and time.monotonic() - last.checked_at < self.ttl_s:
            return last
        async with self._lock:  # concurrent probes share one status call
            last = self._last
            if last is not None and time.monotonic() - last.checked_at < self.ttl_s:
                return last
            started = time.monotonic()
            status = await self._refresh()
            self._last = assess(status, self.lanes, started)
            if not self._last.ready:
                logger.info("not ready: %s", "; ".join(self._last.reasons))
            return self._last


def fetch_readiness(api_url: str | None, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """``GET {api_url}/ready`` (blocking, for the CLI): the JSON answer (200 or 503), None when
    the gateway does not answer with one."""
    import httpx

    if not api_url:
        return None
    try:
        r = httpx.get(api_url.rstrip("/") + "/ready", timeout=timeout_s)
        answer = r.json() if r.status_code in (200, 503) else None
    except (httpx.HTTPError, ValueError):
        return None
    return answer if isinstance(answer, dict) and "ready" in answer else None
