"""Background responses (``POST /v1/responses`` with ``background: true``) and their cancel.

OpenAI's semantics: the create call answers at once with the stored response in status
``queued``; the response runs in the batch lane (DESIGN.md "Tools, Responses, embeddings"), its
stored object goes ``in_progress`` when its first token arrives and ``completed`` /
``incomplete`` / ``failed`` at the end, so ``GET /v1/responses/{id}`` shows where it is.
``POST /v1/responses/{id}/cancel`` aborts a running background response (status
``cancelled``); a finished one (or one another gateway process runs) is returned as it is; a response that was not created in the
background cannot be cancelled (400, OpenAI's wording).

The running ones are held per gateway process (``app.state.background_responses``): a cancel
reaching another gateway of the same stack finds only the stored object.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

import laneserve.api.response_store as store
from laneserve.api.errors import ApiError
from laneserve.api.generate import Generation
from laneserve.contracts.openai import responses as fmt
from laneserve.contracts.openai import responses_api as api

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState

logger = logging.getLogger(__name__)

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass(slots=True)
class Running:
    """A background response in flight: its generation, task and what its stored rows need."""

    gen: Generation
    task: asyncio.Task | None
    owner: str
    items: list[dict]
    body: dict
    created: float


def _registry(request: Request) -> dict[str, Running]:
    app_state = request.app.state
    if not hasattr(app_state, "background_responses"):
        app_state.background_responses = {}
    return app_state.background_responses


async def start(
    request: Request,
    state: GatewayState,
    run: Running,
    finish: Callable[[Generation], Awaitable[dict]],
) -> Response:
    """Submit ``run.gen``, store the ``queued`` object and answer with it; the response runs on
    in a task. ``finish(gen)``: the final response object of a finished generation."""
    run.gen.start()
    queued = _object(run, "queued")
    try:
        await store.put(state, run.owner, run.items, queued)
    except BaseException:
        run.gen.close()
        raise
    registry = _registry(request)
    registry[run.gen.id] = run
    run.task = asyncio.create_task(_follow(state, run, finish, registry))
    return Response(fmt.dumps(queued), media_type="application/json")


def _object(run: Running, status: str, error: dict | None = None) -> dict:
    obj = api.response_object(run.gen.id, run.created, run.body, [], status, None, True)
    obj["error"] = error
    return obj


async def _follow(state, run: Running, finish, registry: dict[str, Running]) -> None:
    gen = run.gen
    try:
        await gen.wait_started()
        if gen.error is None:
            await store.put(state, run.owner, run.items, _object(run, "in_progress"))
            await gen.run_to_end()
        if gen.error is not None:
            err = {"code": gen.error.code, "message": gen.error.message}
            obj = _object(run, "failed", err)
        else:
            obj = await finish(gen)
        await store.put(state, run.owner, run.items, obj)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("background response %s failed", gen.id)
    finally:
        gen.close()
        registry.pop(gen.id, None)


async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``."""
    state: GatewayState = request.app.state.gateway
    resp_id = request.path_params["response_id"]
    owner = store.owner_of(request)
    run = _registry(request).get(resp_id)
    if run is not None and run.owner == owner:
        if run.task is not None:
            run.task.cancel()
        run.gen.close()  # the broker forwards the abort to the worker
        obj = _object(run, "cancelled")
        await store.put(state, owner, run.items, obj)
        return Response(fmt.dumps(obj), media_type="application/json")
    obj = await store.load(state, owner, resp_id)
    if obj is None:
        raise ApiError("not_found", f"Response with id '{resp_id}' not found.")
    if not obj.get("background"):
        raise ApiError("invalid_request", "Only background responses can be cancelled.")
    # finished, or held by another gateway process (which alone can abort it): as it is
    return Response(fmt.dumps(obj), media_type="application/json")
