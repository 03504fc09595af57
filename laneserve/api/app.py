"""The gateway application: :func:`create_app` builds the FastAPI app for an :class:`ApiConfig`.

Routes (OpenAI-compatible unless noted)::

    POST /v1/chat/completions        POST /v1/completions          GET /v1/models
    POST /v1/files                   GET  /v1/files/{id}           GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel
    GET  /health  (liveness, no key)   GET /ready  (readiness, no key; laneserve.api.health)
    GET  /metrics  (Prometheus text; laneserve.api.metrics)

With ``metrics_port`` set, a second listener on ``metrics_host:metrics_port`` serves ``/metrics``
(and ``/health``, ``/ready``) without the user key; the user routes keep needing it.

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
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from laneserve.api import completions, files, tokenize
from laneserve.api import inspection as inspection_routes
from laneserve.api.arrival import ArrivalMiddleware
from laneserve.api.auth import ApiKeyMiddleware
from laneserve.api.config import ApiConfig
from laneserve.api.errors import ApiError, error_response, response_for
from laneserve.api.health import ReadinessProbe
from laneserve.api.metrics import GatewayMetrics
from laneserve.api.model_info import load_served_model
from laneserve.broker.client import BrokerClient
from laneserve.contracts.openai.model import ServedModel
from laneserve.contracts.procs import parent_gone

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
        self.metrics = GatewayMetrics(stack_gauges=config.stack_gauges)
        self.model_info = ServedModel(
            served_name=config.served_model_name, max_model_len=config.max_model_len
        )
        self.client: BrokerClient | None = None
        self.status: dict[str, Any] | None = None
        self.status_at = 0.0  # monotonic s of the last answered status call
        self.readiness = ReadinessProbe(self._probe_status, config.ready_lanes, config.ready_ttl_s)
        self.jobs: Any = None  # files/batches service (laneserve.api.files)
        self.metrics_server: Any = None  # uvicorn server of the metrics port
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            self.model_info = await asyncio.to_thread(load_served_model, self.config)
        except (ValueError, RuntimeError) as exc:  # TokenizerError, ModelLoadError: say why
            logger.error("cannot load the model %s: %s", self.config.model, exc)
            raise
        if self.model_info.served_name:
            self.metrics.model_name = self.model_info.served_name
            self.metrics.served_name = True
        self.client = BrokerClient(self.config.broker)
        await self.client.start()
        await self.refresh_status()
        self.jobs = await asyncio.to_thread(files.open_jobs_service, self.config)
        self._tasks.append(asyncio.create_task(self._poll(), name="gateway-status-poll"))
        if self.config.metrics_port is not None:
            await self._start_metrics_server()
        logger.info(
            "gateway ready: broker %s, model %s, auth %s",
            self.config.broker,
            self.model_info.served_name,
            "on" if self.config.api_key else "off",
        )

    async def _start_metrics_server(self) -> None:
        """Serve /metrics, /health and /ready without the key on the metrics port. The socket
        is bound here, so a port in use fails the start-up with OSError."""
        host, port = self.config.metrics_host, self.config.metrics_port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on the metrics port {host}:{port}: {exc}") from exc
        app = metrics_app(self)
        server = _EmbeddedServer(
            uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        )
        self.metrics_server = server
        self._tasks.append(asyncio.create_task(server.serve([sock]), name="gateway-metrics"))
        logger.info("metrics on http://%s:%d/metrics (no key)", host, sock.getsockname()[1])

    async def stop(self) -> None:
        if self.metrics_server is not None:  # let it close its connections first (<= 2 s)
            self.metrics_server.should_exit = True
            serving = [t for t in self._tasks if t.get_name() == "gateway-metrics"]
            await asyncio.wait(serving, timeout=2.0)
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
        started = time.monotonic()
        try:
            reply = await self.client.status(timeout_s=self.config.broker_timeout_s)
        except TimeoutError:
            logger.warning("broker %s did not answer a status call", self.config.broker)
            self.status = None
            self.metrics.broker.status = None
            self.readiness.observe(None, time.monotonic())
            return False
        self.status = {"workers": reply.workers, "queues": reply.queues, "epoch": reply.epoch}
        self.status_at = time.monotonic()
        self.metrics.broker.status = self.status
        self.metrics.model_name = (self.model_names() or [self.metrics.model_name])[0]
        self.readiness.observe(self.status, started)
        return True

    async def _probe_status(self) -> dict[str, Any] | None:
        """A fresh broker status for the readiness probe (None: the broker does not answer)."""
        return self.status if await self.refresh_status() else None

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
    """Liveness: 200 while the process answers (never waits on the broker). ``?ready=1``:
    the readiness answer, as ``/ready``."""
    if request.query_params.get("ready", "").lower() in ("1", "true", "yes"):
        return await ready(request)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness (laneserve.api.health): 200 or 503 with the reasons."""
    state: GatewayState = request.app.state.gateway
    answer = await state.readiness.check()
    return JSONResponse(answer.to_json(), status_code=200 if answer.ready else 503)


async def model_objects(state: GatewayState) -> list[dict]:
    """The OpenAI model objects of every served name (``/v1/models``, ``/v1/models/{id}``)."""
    if state.status is None or (
        not state.model_names() and time.monotonic() - state.status_at > 0.5
    ):
        await state.refresh_status()  # none known yet: a worker may have joined since the last poll
    created = state.model_info.created
    data = []
    for name in state.model_names():
        entry = {"id": name, "object": "model", "created": created, "owned_by": "laneserve"}
        if name == state.model_info.served_name and state.model_info.max_model_len:
            entry["max_model_len"] = state.model_info.max_model_len
        data.append(entry)
    return data


async def list_models(request: Request) -> Response:
    data = await model_objects(request.app.state.gateway)
    return JSONResponse({"object": "list", "data": data})


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the gateway's registry (laneserve.api.metrics)."""
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
    app.add_api_route("/health", health, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/ready", ready, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    return app


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
    app.add_api_route("/ready", ready, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", tokenize.retrieve_model, methods=["GET"])
    app.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"])
    app.add_api_route("/v1/chat/completions", completions.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions.completions, methods=["POST"])
    files.add_routes(app)
    inspection_routes.add_routes(app)  # GET /v1/batches/{id}/stats, GET /status (laneserve)

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
