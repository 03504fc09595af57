"""``/v1/files`` and ``/v1/batches``: thin HTTP wrappers over the jobs library (jobs.service).

Files can be listed (`GET /v1/files`: `purpose`, and OpenAI's cursor pagination `limit`,
`after`, `order`), retrieved and deleted (`DELETE /v1/files/{id}`: 409 while a batch that has
not ended uses the file; afterwards its metadata and content are 404).

The library is synchronous (SQLAlchemy); each call runs in a worker thread. Its errors carry a
DESIGN.md ``code`` and an HTTP ``status_code`` (400, 404, 409, 413) that map onto the OpenAI
error shape unchanged. Batches created here go to the batch lane: the jobs runner executes them.

Uploads (multipart/form-data, fields ``file`` and ``purpose``) are read under the file size
limit (``ApiConfig.max_file_bytes`` plus room for the multipart framing) before parsing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from laneserve.api.auth import read_body, read_json
from laneserve.api.config import ApiConfig
from laneserve.api.errors import STATUS_BY_CODE, ApiError, invalid

logger = logging.getLogger(__name__)

MULTIPART_OVERHEAD = 64 * 1024  # boundaries, part headers and the purpose field


@dataclass(slots=True)
class JobsService:
    """The database engine the jobs library works on."""

    engine: Any

    def close(self) -> None:
        self.engine.dispose()


def open_jobs_service(config: ApiConfig, *, quiet: bool = False) -> JobsService | None:
    """Migrate the database and open an engine; None (routes answer 503) when it fails
    (logged with its traceback unless `quiet`: the gateway tries again while it runs)."""
    try:
        from laneserve.db import migrate
        from laneserve.db.session import make_engine

        migrate.upgrade(config.db_url)
        return JobsService(make_engine(config.db_url))
    except Exception as exc:
        if not quiet:
            logger.exception("files and batches are unavailable: the database cannot be opened")
        else:
            logger.debug("the database still cannot be opened: %s", exc)
        return None


def database_answers(engine: Any) -> bool:
    """One ``SELECT 1`` on a pooled connection (blocking; bounded by the engine's connect
    timeout): False when the database cannot be reached."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except DBAPIError:
        return False
    return True


def _service(request: Request) -> JobsService:
    svc = request.app.state.gateway.jobs
    if svc is None:
        raise ApiError(
            "database_unavailable",
            "files and batches are unavailable: the database cannot be opened",
        )
    return svc


async def jobs_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a jobs-library call in a thread; its typed errors become ApiError, and a database
    that cannot be reached (down, restarting, SQLite locked) a retryable 503
    ``database_unavailable`` with ``Retry-After``; a full disk (database or files directory)
    a 507 ``insufficient_storage``."""
    from sqlalchemy.exc import DBAPIError

    from laneserve.db.availability import database_unavailable, storage_full
    from laneserve.jobs.errors import JobsError

    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except JobsError as exc:
        code = exc.code if exc.code in STATUS_BY_CODE else "internal"
        raise ApiError(code, str(exc), param=exc.param, status=exc.status_code) from None
    except (DBAPIError, OSError) as exc:
        if storage_full(exc):
            logger.warning("files and batches: no room to write: %s", exc)
            raise ApiError(
                "insufficient_storage", "the server's disk is full; nothing was stored"
            ) from None
        if not database_unavailable(exc):
            raise
        logger.warning("files and batches: the database is unavailable: %s", exc.orig)
        raise ApiError(
            "database_unavailable", "the database is unavailable; retry after Retry-After"
        ) from None


# ---------------------------------------------------------------------------- files


async def create_file(request: Request) -> Response:
    from laneserve.jobs import service

    svc = _service(request)
    limit = request.app.state.gateway.config.max_file_bytes
    body = await read_body(request, limit + MULTIPART_OVERHEAD)
    request._body = body  # Starlette's form parser re-reads the cached body
    if "multipart/form-data" not in request.headers.get("content-type", ""):
        raise invalid("POST /v1/files takes multipart/form-data with 'file' and 'purpose'")
    try:
        form = await request.form()
    except Exception as exc:  # malformed multipart
        raise invalid(f"malformed multipart body: {exc}") from None
    try:
        upload = form.get("file")
        purpose = form.get("purpose") or "batch"
        if upload is None or isinstance(upload, str):
            raise invalid("the 'file' field is required (a file part)", "file")
        if not isinstance(purpose, str):
            raise invalid("'purpose' must be a string", "purpose")
        if upload.size is not None and upload.size > limit:
            raise ApiError("payload_too_large", f"file over {limit} bytes", param="file")
        row = await jobs_call(
            service.create_file, svc.engine, upload.file, upload.filename or "upload", purpose
        )
    finally:
        await form.close()
    return JSONResponse(service.file_object(row))


async def get_file(request: Request) -> Response:
    from laneserve.jobs import service

    row = await jobs_call(
        service.get_file, _service(request).engine, request.path_params["file_id"]
    )
    return JSONResponse(service.file_object(row))


def _query_int(request: Request, name: str, default: int) -> int:
    try:
        return int(request.query_params.get(name, str(default)))
    except ValueError:
        raise invalid(f"'{name}' must be an integer", name) from None


def _page(data: list[dict], more: bool) -> JSONResponse:
    """An OpenAI list object (cursor pagination: the next page starts `after` `last_id`)."""
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def list_files(request: Request) -> Response:
    from laneserve.jobs import service
    from laneserve.jobs.files import LIST_LIMIT_MAX

    q = request.query_params
    rows, more = await jobs_call(
        service.list_files,
        _service(request).engine,
        purpose=q.get("purpose") or None,
        limit=_query_int(request, "limit", LIST_LIMIT_MAX),
        after=q.get("after") or None,
        order=q.get("order", "desc"),
    )
    return _page([service.file_object(row) for row in rows], more)


async def delete_file(request: Request) -> Response:
    from laneserve.jobs import service

    file_id = request.path_params["file_id"]
    await jobs_call(service.delete_file, _service(request).engine, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def file_content(request: Request) -> Response:
    from laneserve.jobs import service

    path = await jobs_call(
        service.file_path, _service(request).engine, request.path_params["file_id"]
    )
    return FileResponse(path, media_type="application/octet-stream")


# ---------------------------------------------------------------------------- batches

_BATCH_FIELDS = frozenset(
    {"input_file_id", "endpoint", "completion_window", "metadata", "model", "task", "task_options"}
)


async def create_batch(request: Request) -> Response:
    from laneserve.jobs import service

    state = request.app.state.gateway
    svc = _service(request)
    body = await read_json(request, state.config.max_body_bytes)
    if type(body) is not dict:
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - _BATCH_FIELDS)
    if unknown:
        raise invalid(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    for name in ("input_file_id", "endpoint"):
        if type(body.get(name)) is not str:
            raise invalid(f"'{name}' is required and must be a string", name)
    window = body.get("completion_window") or "24h"
    if type(window) is not str:
        raise invalid("'completion_window' must be a string", "completion_window")
    model = body.get("model")
    if model is not None:
        if type(model) is not str or not model:
            raise invalid("'model' must be a non-empty string", "model")
        await state.check_model(model)  # a 404 now, not a job whose every line fails later
    model = model or state.model_info.served_name
    job = await jobs_call(
        service.create_batch,
        svc.engine,
        body["input_file_id"],
        body["endpoint"],
        window,
        body.get("metadata"),
        task=body.get("task"),
        task_options=body.get("task_options"),
        model=model,
        max_tokens_limit=state.config.max_tokens_limit,
    )
    return JSONResponse(service.batch_object(job))


async def list_batches(request: Request) -> Response:
    from laneserve.jobs import service

    limit = _query_int(request, "limit", 20)
    engine = _service(request).engine
    jobs = await jobs_call(
        service.list_batches, engine, limit=limit, after=request.query_params.get("after")
    )
    more = False
    if len(jobs) == limit:
        more = bool(await jobs_call(service.list_batches, engine, 1, jobs[-1].id))
    return _page([service.batch_object(j) for j in jobs], more)


async def get_batch(request: Request) -> Response:
    from laneserve.jobs import service
    from laneserve.jobs.stats import batch_stats, usage_of

    engine = _service(request).engine
    job = await jobs_call(service.get_batch, engine, request.path_params["batch_id"])
    stats = await jobs_call(batch_stats, engine, job.id, latency=False)
    return JSONResponse(service.batch_object(job) | {"usage": usage_of(stats)})


async def cancel_batch(request: Request) -> Response:
    from laneserve.jobs import service

    job = await jobs_call(
        service.cancel_batch, _service(request).engine, request.path_params["batch_id"]
    )
    return JSONResponse(service.batch_object(job))


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/files", create_file, methods=["POST"])
    app.add_api_route("/v1/files", list_files, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", get_file, methods=["GET"])
    app.add_api_route("/v1/files/{file_id}", delete_file, methods=["DELETE"])
    app.add_api_route("/v1/files/{file_id}/content", file_content, methods=["GET"])
    app.add_api_route("/v1/batches", create_batch, methods=["POST"])
    app.add_api_route("/v1/batches", list_batches, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}", get_batch, methods=["GET"])
    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])
