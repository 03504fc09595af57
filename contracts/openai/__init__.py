"""The one OpenAI request/response layer, shared by the HTTP gateway and bulk-job lines.

- :mod:`laneserve.contracts.openai.requests`: parse and validate ``/v1/chat/completions`` and
  ``/v1/completions`` bodies (:func:`parse`, :class:`ParsedRequest`, :class:`Limits`) and map
  them to the wire ``sampling_params`` (:data:`SAMPLING_KEYS`, the one list of sampling keys);
- :mod:`laneserve.contracts.openai.embeddings`: ``/v1/embeddings`` bodies and responses;
  :func:`parse` (:mod:`laneserve.contracts.openai.endpoints`) takes any of the three endpoints;
- :mod:`laneserve.contracts.openai.model`: the served model at the edge (names, tokenizer, context
  length): prompt counting with the engine's rule, ``max_tokens`` settlement (:class:`ServedModel`);
- :mod:`laneserve.contracts.openai.responses`: completion objects, stream chunks, usage, logprobs, SSE;
- :mod:`laneserve.contracts.openai.errors`: :class:`OpenAIError` and OpenAI's error JSON, DESIGN.md's codes;
- :mod:`laneserve.contracts.openai.checks`: the typed field checks behind every 400.

A batch line therefore accepts exactly the bodies the API accepts and fails with the same
message; the gateway adds HTTP (status codes, SSE), the jobs runner adds the batch file format.
"""

from laneserve.contracts.openai.embeddings import EMBEDDINGS_ENDPOINT
from laneserve.contracts.openai.endpoints import parse
from laneserve.contracts.openai.errors import OpenAIError, error_body, invalid, model_not_found
from laneserve.contracts.openai.model import ServedModel
from laneserve.contracts.openai.requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    SAMPLING_KEYS,
    Limits,
    ParsedRequest,
    Prompt,
    parse_chat,
    parse_completion,
)

__all__ = [
    "CHAT_ENDPOINT",
    "COMPLETIONS_ENDPOINT",
    "EMBEDDINGS_ENDPOINT",
    "SAMPLING_KEYS",
    "Limits",
    "OpenAIError",
    "ParsedRequest",
    "Prompt",
    "ServedModel",
    "error_body",
    "invalid",
    "model_not_found",
    "parse",
    "parse_chat",
    "parse_completion",
]
