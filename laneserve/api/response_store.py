"""Stored Responses API answers in SQL (table ``responses``, :class:`laneserve.db.models.StoredResponse`):
``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is stored when its body leaves ``store`` out or sets it true (OpenAI's default) and the
gateway has its database (the one files and batches use); without one, ``store`` is answered
``false`` and ``previous_response_id`` / ``GET`` are a 503. Rows belong to the API key that made
them (its SHA-256): another key's id reads as not found, as OpenAI words it. A database that stops
answering makes ``GET``/``DELETE``/``previous_response_id`` a retryable 503 and a new response
unstored (``store: false``), never a failed generation.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from laneserve.api.errors import ApiError
from laneserve.api.files import jobs_call
from laneserve.contracts.openai import responses as fmt

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState

logger = logging.getLogger(__name__)


def owner_of(request: Request) -> str:
    """The SHA-256 (hex) of the request's bearer token: who a stored response belongs to."""
    _scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return hashlib.sha256(token.strip().encode()).hexdigest()


def engine_of(state: GatewayState) -> Any:
    """The database engine of stored responses. Raises ApiError 503 without the database."""
    if state.jobs is None:
        raise ApiError(
            "database_unavailable", "stored responses need the database, which is unavailable"
        )
    return state.jobs.engine


def _not_found(resp_id: str, param: str | None = None) -> ApiError:
    what = "Previous response" if param else "Response"
    return ApiError("not_found", f"{what} with id '{resp_id}' not found.", param=param)


def _load(engine: Any, owner: str, resp_id: str) -> Any:
    from laneserve.db.models import StoredResponse
    from laneserve.db.session import read_session

    with read_session(engine) as session:
        row = session.get(StoredResponse, resp_id)
        return row if row is not None and row.owner == owner else None


def _save(engine: Any, owner: str, items: list[dict], obj: dict) -> None:
    from laneserve.db.models import StoredResponse
    from laneserve.db.session import write_session

    row = StoredResponse(
        id=obj["id"], owner=owner, created_at=obj["created_at"], input_items=items, response=obj
    )
    with write_session(engine) as session:
        session.add(row)


def _delete(engine: Any, owner: str, resp_id: str) -> bool:
    from laneserve.db.models import StoredResponse
    from laneserve.db.session import write_session

    with write_session(engine) as session:
        row = session.get(StoredResponse, resp_id)
        if row is None or row.owner != owner:
            return False
        session.delete(row)
        return True


async def history(request: Request, state: GatewayState, prev_id: Any) -> list[dict]:
    """The input items that precede a new turn continuing ``prev_id``: that response's input
    items, then its output. Raises ApiError 404 naming ``previous_response_id``."""
    if type(prev_id) is not str:
        raise ApiError(
            "invalid_request",
            "'previous_response_id' must be a string",
            param="previous_response_id",
        )
    row = await jobs_call(_load, engine_of(state), owner_of(request), prev_id)
    if row is None:
        raise _not_found(prev_id, "previous_response_id")
    return [*row.input_items, *row.response["output"]]


def can_store(body: dict, state: GatewayState) -> bool:
    return body.get("store") is not False and state.jobs is not None


async def save(request: Request, state: GatewayState, items: list[dict], obj: dict) -> bool:
    """Store ``obj``; False (logged) when the database cannot take it now: the answer is still
    sent, with ``store: false``, as chats do not depend on SQL."""
    try:
        await jobs_call(_save, state.jobs.engine, owner_of(request), items, obj)
    except ApiError as exc:
        logger.warning("response %s not stored: %s", obj["id"], exc.message)
        return False
    return True


async def get_response(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    resp_id = request.path_params["response_id"]
    row = await jobs_call(_load, engine_of(state), owner_of(request), resp_id)
    if row is None:
        raise _not_found(resp_id)
    return Response(fmt.dumps(row.response), media_type="application/json")


async def delete_response(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    resp_id = request.path_params["response_id"]
    if not await jobs_call(_delete, engine_of(state), owner_of(request), resp_id):
        raise _not_found(resp_id)
    body = {"id": resp_id, "object": "response", "deleted": True}
    return Response(fmt.dumps(body), media_type="application/json")


__all__ = [
    "can_store", "delete_response", "engine_of", "get_response", "history", "owner_of", "save"
]  # fmt: skip
