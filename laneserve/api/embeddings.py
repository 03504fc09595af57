"""``POST /v1/embeddings``: one engine request (task ``embed``) per input, through the broker.

The flow is the completions' (:mod:`laneserve.api.completions`): arrival stamped first, body
validated (:func:`laneserve.contracts.openai.embeddings.parse_embedding`), model and lane checked,
inputs tokenized and counted once at the edge, then every input submitted as its own request
(:class:`~laneserve.api.generate.Generation`; the response ``id`` is the first input's
``requests.id``) and the answer built once all have finished. Never streamed.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from laneserve.api.arrival import arrival
from laneserve.api.auth import read_json
from laneserve.api.completions import checked_generation, respond
from laneserve.api.errors import ApiError
from laneserve.api.generate import Generation
from laneserve.contracts.openai.embeddings import (
    embeddings_response,
    encoding_format,
    parse_embedding,
)

if TYPE_CHECKING:
    from laneserve.api.state import GatewayState


async def create_embeddings(request: Request) -> Response:
    arrived = arrival(request.scope)  # before the body is read
    state: GatewayState = request.app.state.gateway
    body = await read_json(request, state.config.max_body_bytes)
    gen = await checked_generation(
        state, parse_embedding(body), "embd-" + uuid.uuid4().hex, arrived
    )
    fmt = encoding_format(body)
    return await respond(request, gen, False, lambda: _body(gen, fmt), _no_stream)


def _body(gen: Generation, fmt: str) -> dict:
    vectors = [c.embedding for c in gen.choices]
    if any(v is None for v in vectors):  # a worker that computes no embeddings answered
        raise ApiError("engine_error", "the worker sent no embedding for an input")
    usage = gen.usage()
    return embeddings_response(gen.req.model, vectors, fmt, usage["prompt_tokens"])


def _no_stream():  # respond() needs a stream factory; embeddings are never streamed
    raise AssertionError("embeddings are not streamed")
