"""The gateway application: :func:`create_app` builds the FastAPI app for an :class:`ApiConfig`.

Routes (OpenAI-compatible unless noted)::

    POST /v1/chat/completions        POST /v1/completions          GET /v1/models
    POST /v1/responses   GET /v1/responses/{id}   DELETE /v1/responses/{id}
    POST /v1/responses/{id}/cancel  (background responses)
    POST /v1/embeddings
    POST /v1/files                   GET  /v1/files/{id}           GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel
    GET  /health  (liveness, no key)   GET /ready  (readiness, no key; laneserve.api.health)
    GET  /metrics  (Prometheus text; laneserve.api.metrics)

With ``metrics_port`` set, a second listener on ``metrics_host:metrics_port`` serves ``/metrics``
(and ``/health``, ``/ready``) without the user key; the user routes keep needing it
(:mod:`laneserve.api.probes`).

The app's shared state, and what its lifespan starts and stops, is
:class:`laneserve.api.state.GatewayState`. Every HTTP request is stamped on arrival by the
outermost middleware (:mod:`laneserve.api.arrival`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from laneserve.api.arrival import ArrivalMiddleware
from laneserve.api.auth import ApiKeyMiddleware
from laneserve.api.completions import chat_completions, completions
from laneserve.api.config import ApiConfig
from laneserve.api.embeddings import create_embeddings
from laneserve.api.errors import ApiError, error_response, response_for
from laneserve.api.files import add_routes as add_file_routes
from laneserve.api.inspection import add_routes as add_inspection_routes
from laneserve.api.probes import add_probe_routes
from laneserve.api.response_background import cancel_response
from laneserve.api.response_store import delete_response, get_response
from laneserve.api.responses import create_response
from laneserve.api.state import GatewayState, model_objects
from laneserve.api.tokenize import detokenize, retrieve_model, tokenize

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


async def list_models(request: Request) -> Response:
    data = await model_objects(request.app.state.gateway)
    return JSONResponse({"object": "list", "data": data})


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
    add_probe_routes(app)  # /health, /ready, /metrics
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    app.add_api_route("/v1/embeddings", create_embeddings, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])
    add_file_routes(app)
    add_inspection_routes(app)  # GET /v1/batches/{id}/stats, GET /status (laneserve)

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
