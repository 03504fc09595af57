"""One entry point for every body the gateway and batch lines parse: :func:`parse` by endpoint
(chat and completions in :mod:`laneserve.contracts.openai.requests`, embeddings in
:mod:`laneserve.contracts.openai.embeddings`)."""

from __future__ import annotations

from typing import Any

from laneserve.contracts.openai.embeddings import EMBEDDINGS_ENDPOINT, parse_embedding
from laneserve.contracts.openai.errors import invalid
from laneserve.contracts.openai.requests import Limits, ParsedRequest
from laneserve.contracts.openai.requests import parse as parse_completions
from laneserve.contracts.openai.responses_api import parse_response_request

RESPONSES_ENDPOINT = "/v1/responses"


def parse(endpoint: str, body: Any, limits: Limits) -> ParsedRequest:
    """Validate a body for ``endpoint`` (``/v1/chat/completions``, ``/v1/completions`` or
    ``/v1/embeddings``), or ``/v1/responses`` without a ``previous_response_id`` (a batch line
    has no stored conversation: a 400 naming it).

    Raises:
        OpenAIError: 400 ``invalid_request`` naming the field.
        ValueError: any other endpoint (a caller's bug).
    """
    if endpoint == EMBEDDINGS_ENDPOINT:
        return parse_embedding(body)
    if endpoint == RESPONSES_ENDPOINT:
        if type(body) is dict and body.get("previous_response_id") is not None:
            raise invalid(
                "'previous_response_id' is not supported in a batch line (send the whole "
                "conversation as 'input')",
                "previous_response_id",
            )
        return parse_response_request(body, limits)
    return parse_completions(endpoint, body, limits)
