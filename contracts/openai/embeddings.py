"""``/v1/embeddings``: the request body -> :class:`ParsedRequest` (kind ``"embedding"``), and the
``list`` of ``embedding`` objects OpenAI answers with.

Fields follow the OpenAI API reference (embeddings): ``input`` (a string, an array of strings,
an array of token ids or an array of such arrays), ``model``, ``encoding_format`` (``"float"``,
the default, or ``"base64"``: the little-endian float32 bytes, base64-encoded, as the ``openai``
SDK decodes them), ``dimensions`` (only for models trained to shorten their vectors, which no
model laneserve serves does: a 400 naming it) and ``user`` (ignored). Laneserve's ``lane``,
``priority`` and OpenAI's ``service_tier`` pick the lane as for completions.

The engine pools the served model's final hidden states (``--pooling-type``, gpu_worker/pooling.py)
and normalizes them; the vector arrives as float32 bytes (``Final.embedding``).
"""

from __future__ import annotations

import array
import base64
import sys
from typing import Any

from laneserve.contracts.openai.checks import given
from laneserve.contracts.openai.errors import OpenAIError, invalid
from laneserve.contracts.openai.requests import (
    ParsedRequest,
    _check_fields,
    _lane,
    _model,
    _prompts,
)

EMBEDDINGS_ENDPOINT = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
# Inputs in one request: each is an engine request, and the broker's interactive queue holds 256
# (more would be refused as `overloaded`); send larger corpora in several requests or a batch file.
MAX_EMBEDDING_INPUTS = 256
EMBEDDING_FIELDS = frozenset(
    {"model", "input", "encoding_format", "dimensions", "lane", "priority", "service_tier"}
)


def parse_embedding(body: Any) -> ParsedRequest:
    """Validate a /v1/embeddings body. Raises OpenAIError (400) naming the field.

    The result's ``prompts`` are the inputs in order; ``encoding_format`` is kept on
    ``sampling`` under no wire key (see :func:`encoding_format`), ``max_tokens`` is 1 so the
    edge's length check (prompt + 1 token within ``max_model_len``) is the engine's."""
    body = _check_fields(body, EMBEDDING_FIELDS)
    if given(body.get("dimensions")):
        raise invalid(
            "'dimensions' is not supported by this model (its vectors have one size; leave "
            "'dimensions' out)",
            "dimensions",
        )
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise invalid(
            f"'encoding_format' must be one of {list(ENCODING_FORMATS)}, got {fmt!r}",
            "encoding_format",
        )
    if body.get("input") is None:
        raise invalid("'input' is required", "input")
    try:
        prompts = _prompts(body.get("input"), MAX_EMBEDDING_INPUTS)
    except OpenAIError as exc:  # the completions wording names 'prompt'
        message = exc.message.replace("'prompt'", "'input'").replace("prompts", "inputs")
        raise invalid(message, "input") from None
    req = ParsedRequest(kind="embedding", model=_model(body), prompts=prompts, max_tokens=1)
    _lane(body, req)
    req.sampling = {}
    return req


def encoding_format(body: dict) -> str:
    """The body's ``encoding_format`` (validated by :func:`parse_embedding`), default float."""
    return body.get("encoding_format") or "float"


def embedding_object(index: int, vector: bytes, fmt: str) -> dict[str, Any]:
    """One ``embedding`` object of the response from the engine's float32 bytes."""
    if fmt == "base64":
        data: Any = base64.b64encode(vector).decode("ascii")
    else:
        floats = array.array("f")
        floats.frombytes(vector)
        if sys.byteorder != "little":
            floats.byteswap()
        data = floats.tolist()
    return {"object": "embedding", "index": index, "embedding": data}


def embeddings_response(
    model: str, vectors: list[bytes], fmt: str, prompt_tokens: int
) -> dict[str, Any]:
    """The ``list`` object of ``/v1/embeddings`` (OpenAI's shape; usage counts prompt tokens)."""
    return {
        "object": "list",
        "data": [embedding_object(i, v, fmt) for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
