"""The gateway application: :func:`create_app` builds the FastAPI app for an :class:`ApiConfig`.

Routes (OpenAI-compatible unless noted)::

    POST /v1/chat/completions        POST /v1/completions          GET /v1/models
    POST /v1/files                   GET  /v1/files/{id}           GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel
    GET  /health  (no key; laneserve)  GET /metrics  (Prometheus text; laneserve)

Start-up (lifespan): load the model's tokenizer (``tokenizer.json``, no torch), connect the
broker client, start the status poller (workers per lane for the 503 check, gauges for /metrics,
parent-pid watch). Every HTTP request is stamped on arrival by the outermost middleware
(:mod:`laneserve.api.arrival`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.client import BrokerClient
from contracts.openai.model import ServedModel
from contracts.procs import parent_gone
from laneserve.api import completions, files
from laneserve.api.arrival import ArrivalMiddleware
from laneserve.api.auth import ApiKeyMiddleware
from laneserve.api.config import ApiConfig
from laneserve.api.errors import ApiError, error_response, response_for
from laneserve.api.metrics import GatewayMetrics
from laneserve.api.model_info import load_served_model

logger = logging.getLogger(__name__)

_CODE_BY_STATUS = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    429: "overloaded",
    503: "no_worker",
    504: "deadline_exceeded",
}


class GatewayState:
    """Per-app state: config, broker client, model info, metrics, last broker status."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.model_info = ServedModel(
            served_name=config.served_model_name, max_model_len=config.max_model_len
        )
        self.client: BrokerClient | None = None
        self.status: dict[str, Any] | None = None
        self.status_at = 0.0  # monotonic s of the last answered status call
        self.jobs: Any = None  # files/batches service (laneserve.api.files)
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            self.model_info = await asyncio.to_thread(load_served_model, self.config)
        except (ValueError, RuntimeError) as exc:  # TokenizerError, ModelLoadError: say why
            logger.error("cannot load the model %s: %s", self.config.model, exc)
            raise
        self.client = BrokerClient(self.config.broker)
        await self.client.start()
        await self.refresh_status()
        self.jobs = await asyncio.to_thread(files.open_jobs_service, self.config)
        self._tasks.append(asyncio.create_task(self._poll(), name="gateway-status-poll"))
        logger.info(
            "gateway ready: broker %s, model %s, auth %s",
            self.config.broker,
            self.model_info.served_name,
            "on" if self.config.api_key else "off",
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.client is not None:
            await self.client.close()
        if self.jobs is not None and hasattr(self.jobs, "close"):
            await asyncio.to_thread(self.jobs.close)

    async def _poll(self) -> None:
        parent = self.config.parent_pid
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            if parent_gone(parent):
                logger.warning("parent process %d is gone: stopping", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            await self.refresh_status()

    async def refresh_status(self) -> bool:
        """Ask the broker for its status; False when it does not answer in time."""
        assert self.client is not None
        try:
            reply = await self.client.status(timeout_s=self.config.broker_timeout_s)
        except TimeoutError:
            logger.warning("broker %s did not answer a status call", self.config.broker)
            self.status = None
            self.metrics.broker.status = None
            return False
        self.status = {"workers": reply.workers, "queues": reply.queues, "epoch": reply.epoch}
        self.status_at = time.monotonic()
        self.metrics.broker.status = self.status
        return True

    # ------------------------------------------------------------------ checks

    def model_names(self) -> list[str]:
        names = [self.model_info.served_name] if self.model_info.served_name else []
        for w in (self.status or {}).get("workers") or []:
            m = w.get("model")
            if isinstance(m, str) and m and m not in names:
                names.append(m)
        return names

    async def check_model(self, model: str) -> None:
        """Raises ApiError ``not_found`` (404) for a model nobody serves."""
        if model in self.model_names():
            return
        if time.monotonic() - self.status_at > 0.5:
            await self.refresh_status()
        self.model_info.check_name(model, self.model_names())

    def _serves(self, lane: str) -> bool:
        workers = (self.status or {}).get("workers") or []
        return any(lane in (w.get("lanes") or []) and not w.get("draining") for w in workers)

    async def check_lane(self, lane: str) -> None:
        """Raises ApiError ``no_worker`` (503) when no live worker serves ``lane``."""
        if self._serves(lane):
            return
        if not await self.refresh_status():
            raise ApiError("no_worker", f"the broker at {self.config.broker} does not answer")
        if not self._serves(lane):
            raise ApiError("no_worker", f"no worker serves the {lane} lane")


# ---------------------------------------------------------------------------- routes


async def health(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    workers = (state.status or {}).get("workers") or []
    return JSONResponse(
        {"status": "ok", "broker": state.status is not None, "workers": len(workers)}
    )


async def list_models(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    if state.status is None:
        await state.refresh_status()
    created = state.model_info.created
    data = []
    for name in state.model_names():
        entry = {"id": name, "object": "model", "created": created, "owned_by": "laneserve"}
        if name == state.model_info.served_name and state.model_info.max_model_len:
            entry["max_model_len"] = state.model_info.max_model_len
        data.append(entry)
    return JSONResponse({"object": "list", "data": data})


async def metrics(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    if time.monotonic() - state.status_at > state.config.status_interval_s / 2:
        await state.refresh_status()
    if state.jobs is not None:
        try:
            await asyncio.to_thread(state.metrics.jobs.refresh, state.jobs.engine)
        except Exception:  # the database is down: serve the last counts, say why in the log
            logger.exception("reading bulk-job counts for /metrics failed")
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------- factory


def create_app(config: ApiConfig) -> FastAPI:
    """The gateway app for ``config`` (serve it with uvicorn; one event loop per app)."""
    state = GatewayState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="laneserve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.gateway = state
    app.add_api_route("/health", health, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", completions.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions.completions, methods=["POST"])
    files.add_routes(app)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return response_for(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = _CODE_BY_STATUS.get(exc.status_code, "internal")
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        return error_response(code, detail)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response("internal", "internal server error")

    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(ArrivalMiddleware)  # added last: the outermost, runs first
    return app
