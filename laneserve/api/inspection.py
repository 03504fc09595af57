"""Read-only laneserve routes for the CLI on any host (API key protected like every route but
``/health``)::

    GET /v1/batches/{id}/stats   a job's tokens, throughput, TTFT/e2e percentiles, ETA, files
                                 (:func:`laneserve.jobs.stats.batch_stats`; 404 for an unknown batch;
                                 ``?latency=0`` leaves the percentiles out: cheaper to poll)
    GET /status                  the broker as the gateway sees it: {"broker": bool, "model",
                                 "workers": [...], "queues": {...}} (workers as the broker
                                 reports them: worker_id, pid, lanes, model, capacity, load)

``laneserve jobs show|watch``, ``submit --wait`` and ``laneserve status --url`` read them; the
OpenAI batch object has no room for these figures.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from laneserve.api.errors import ApiError


async def batch_stats(request: Request) -> Response:
    from laneserve.api.files import jobs_call
    from laneserve.jobs.stats import batch_stats as compute

    svc = request.app.state.gateway.jobs
    if svc is None:
        raise ApiError("database_unavailable", "files and batches are unavailable: no database")
    latency = request.query_params.get("latency", "1") not in ("0", "false")
    stats = await jobs_call(compute, svc.engine, request.path_params["batch_id"], latency=latency)
    return JSONResponse(stats.to_dict())


async def stack_status(request: Request) -> Response:
    state = request.app.state.gateway
    if time.monotonic() - state.status_at > state.config.status_interval_s / 2:
        await state.refresh_status()
    status = state.status or {}
    return JSONResponse(
        {
            "object": "laneserve.status",
            "broker": state.status is not None,
            "model": state.model_info.served_name,
            "workers": status.get("workers") or [],
            "queues": status.get("queues") or {},
        }
    )


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/batches/{batch_id}/stats", batch_stats, methods=["GET"])
    app.add_api_route("/status", stack_status, methods=["GET"], include_in_schema=False)
