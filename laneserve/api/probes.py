"""The unkeyed probe routes and the metrics port.

``GET /health`` (liveness), ``GET /ready`` (readiness, :mod:`laneserve.api.health`) and
``GET /metrics`` (Prometheus text, :mod:`laneserve.api.metrics`) answer on the gateway's own port
and, with ``metrics_port`` set, on a second listener on ``metrics_host:metrics_port``
(:func:`serve_metrics_port`) that never asks for the user key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from laneserve.db.availability import database_unavailable

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState

logger = logging.getLogger(__name__)


async def health(request: Request) -> Response:
    """Liveness: 200 while the process answers (never waits on the broker). ``?ready=1``:
    the readiness answer, as ``/ready``."""
    if request.query_params.get("ready", "").lower() in ("1", "true", "yes"):
        return await ready(request)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness (laneserve.api.health): 200 or 503 with the reasons, plus ``database``: the
    files/batches database answered its last check (false: `/v1/files` and `/v1/batches`
    answer 503 ``database_unavailable`` meanwhile; chats and completions do not need it, so
    it does not make the gateway unready)."""
    state: GatewayState = request.app.state.gateway
    answer = await state.readiness.check()
    body = answer.to_json() | {"database": state.database}
    return JSONResponse(body, status_code=200 if answer.ready else 503)


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the gateway's registry (laneserve.api.metrics)."""
    state: GatewayState = request.app.state.gateway
    if time.monotonic() - state.status_at > state.config.status_interval_s / 2:
        await state.refresh_status()
    if state.jobs is not None:
        try:
            await asyncio.to_thread(state.metrics.jobs.refresh, state.jobs.engine)
        except Exception as exc:  # the database is down: serve the last counts, say why
            if not database_unavailable(exc):
                logger.exception("reading bulk-job counts for /metrics failed")
            else:
                logger.warning("bulk-job counts for /metrics: the database is unavailable")
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def add_probe_routes(app: FastAPI) -> None:
    """Route /health, /ready and /metrics of ``app`` (left out of the OpenAPI schema)."""
    app.add_api_route("/health", health, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/ready", ready, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


# ---------------------------------------------------------------------------- metrics port


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server run as a task inside the gateway's loop: the gateway's own server
    owns the signals, so this one installs no handlers (it stops via ``should_exit``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def metrics_app(state: GatewayState) -> FastAPI:
    """The metrics-port app: /metrics, /health and /ready of ``state``, no key."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = state
    add_probe_routes(app)
    return app


def serve_metrics_port(state: GatewayState) -> tuple[uvicorn.Server, asyncio.Task]:
    """Serve /metrics, /health and /ready of ``state`` without the key on
    ``metrics_host:metrics_port``, as a task named ``gateway-metrics`` of the running loop.
    Returns the server (stop it with ``should_exit``) and that task.

    Raises:
        OSError: the port cannot be bound (in use), so the gateway's start-up fails.
    """
    host, port = state.config.metrics_host, state.config.metrics_port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on the metrics port {host}:{port}: {exc}") from exc
    app = metrics_app(state)
    server = _EmbeddedServer(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )
    task = asyncio.create_task(server.serve([sock]), name="gateway-metrics")
    logger.info("metrics on http://%s:%d/metrics (no key)", host, sock.getsockname()[1])
    return server, task
