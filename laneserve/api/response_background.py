"""Background responses (``POST /v1/responses`` with ``background: true``) and their cancel.

OpenAI's semantics: the create call answers at once with the stored response in status
``queued``; the response runs in the batch lane (DESIGN.md "Tools, Responses, embeddings"), its
stored object goes ``in_progress`` when its first token arrives and ``completed`` /
``incomplete`` / ``failed`` at the end, so ``GET /v1/responses/{id}`` shows where it is.
``POST /v1/responses/{id}/cancel`` aborts a running background response (status
``cancelled``); a finished one is returned as it is; a response that was not created in the
background cannot be cancelled (400, OpenAI's wording).

The running ones are held per gateway process (``GatewayState.background``), each under a lease
in its row (:mod:`laneserve.api.response_leases`): every status write is conditional on the
lease, and the heartbeat (:mod:`laneserve.api.response_recovery`) renews it and stops a run
whose lease is gone. A cancel reaching another gateway of the same stack marks the row
``cancelled`` and releases the lease, so the gateway running it aborts it at its next renewal.
A response whose gateway died is run again from its stored body by whichever gateway claims
its lapsed lease (:mod:`laneserve.api.response_recovery`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

import laneserve.api.response_leases as leases
import laneserve.api.response_store as store
from laneserve.api.errors import ApiError
from laneserve.api.files import jobs_call
from laneserve.api.generate import Generation
from laneserve.contracts.openai import responses as fmt
from laneserve.contracts.openai import responses_api as api

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Running:
    """A background response in flight: its generation, task and what its stored rows need."""

    gen: Generation
    task: asyncio.Task | None
    owner: str
    items: list[dict]
    body: dict
    created: float


async def start(
    state: GatewayState, run: Running, finish: Callable[[Generation], Awaitable[dict]]
) -> Response:
    """Submit ``run.gen``, store the ``queued`` object (with its body and this process's lease)
    and answer with it; the response runs on in a task. ``finish(gen)``: the final response
    object of a finished generation."""
    run.gen.start()
    queued = _object(run, "queued")
    try:
        await jobs_call(
            leases.insert, store.engine_of(state), run.owner, run.items, queued, run.body,
            state.instance_id, state.config.background_lease_s,
        )  # fmt: skip
    except BaseException:
        run.gen.close()
        raise
    follow(state, run, finish)
    return Response(fmt.dumps(queued), media_type="application/json")


def follow(state: GatewayState, run: Running, finish: Callable[[Generation], Awaitable[dict]]):
    """Hold ``run`` (started, its lease held by this process) and follow it to its end."""
    state.background[run.gen.id] = run
    run.task = asyncio.create_task(_follow(state, run, finish))


async def _write_held(state: GatewayState, run: Running, obj: dict, final: bool = False) -> bool:
    """Store ``obj`` if this process still holds the response's lease (renewed; released when
    ``final``); False when it does not (nothing written)."""
    lease_s = None if final else state.config.background_lease_s
    return await jobs_call(
        leases.write_held, store.engine_of(state), run.gen.id, state.instance_id, obj, lease_s
    )


def _object(run: Running, status: str, error: dict | None = None) -> dict:
    obj = api.response_object(run.gen.id, run.created, run.body, [], status, None, True)
    obj["error"] = error
    return obj


async def _follow(state: GatewayState, run: Running, finish) -> None:
    """Store ``in_progress`` at the first token and the final object at the end. A write the
    database refuses ends the run here with its lease held: the lease lapses and the response
    runs again (here or on another gateway)."""
    gen = run.gen
    try:
        await gen.wait_started()
        if gen.error is None:
            if not await _write_held(state, run, _object(run, "in_progress")):
                logger.info("background response %s: lease gone, stopping it", gen.id)
                return
            await gen.run_to_end()
        if gen.error is not None:
            err = {"code": gen.error.code, "message": gen.error.message}
            obj = _object(run, "failed", err)
        else:
            obj = await finish(gen)
        if not await _write_held(state, run, obj, final=True):
            logger.info("background response %s: lease gone, its result is dropped", gen.id)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("background response %s failed", gen.id)
    finally:
        gen.close()
        if state.background.get(gen.id) is run:
            del state.background[gen.id]


async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``."""
    state: GatewayState = request.app.state.gateway
    resp_id = request.path_params["response_id"]
    owner = store.owner_of(request)
    run = state.background.get(resp_id)
    if run is not None and run.owner == owner:
        if run.task is not None:
            run.task.cancel()
        run.gen.close()  # the broker forwards the abort to the worker
        obj = _object(run, "cancelled")
        if await _write_held(state, run, obj, final=True):
            return Response(fmt.dumps(obj), media_type="application/json")
    # held by another gateway process (which aborts it once its lease is released), or ended
    obj = await jobs_call(leases.cancel, store.engine_of(state), owner, resp_id)
    if obj is None:
        raise ApiError("not_found", f"Response with id '{resp_id}' not found.")
    if not obj.get("background"):
        raise ApiError("invalid_request", "Only background responses can be cancelled.")
    return Response(fmt.dumps(obj), media_type="application/json")
