"""One entry point for every body the gateway and batch lines parse: :func:`parse` by endpoint
(chat and completions in :mod:`laneserve.contracts.openai.requests`, embeddings in
:mod:`laneserve.contracts.openai.embeddings`)."""

from __future__ import annotations

from typing import Any

from laneserve.contracts.openai.embeddings import EMBEDDINGS_ENDPOINT, parse_embedding
from laneserve.contracts.openai.requests import Limits, ParsedRequest
from laneserve.contracts.openai.requests import parse as parse_completions


def parse(endpoint: str, body: Any, limits: Limits) -> ParsedRequest:
    """Validate a body for ``endpoint`` (``/v1/chat/completions``, ``/v1/completions`` or
    ``/v1/embeddings``).

    Raises:
        OpenAIError: 400 ``invalid_request`` naming the field.
        ValueError: any other endpoint (a caller's bug).
    """
    if endpoint == EMBEDDINGS_ENDPOINT:
        return parse_embedding(body)
    return parse_completions(endpoint, body, limits)
