"""The request contract from edge to engine: `EngineRequest` in, `EngineOutput` out (torch-free).

The edge (HTTP gateway) and the jobs runner template and tokenize a prompt once
(:func:`laneserve.contracts.tokens.prompt_ids`) and build an :class:`EngineRequest`; the broker
routes it on its header fields (lane, priority); the worker hands it to the engine's ``add``. The
engine takes token ids only. A sender without a tokenizer (a CLI or SDK client, an edge started
without one) sends the prompt as text or chat messages (:class:`TextRequest`); the worker's front
end (``gpu_worker/prompt_encoder.py``, the same rule) templates and tokenizes it once and builds
the :class:`EngineRequest`, as the offline ``LLM`` does for its text prompts.

Every engine step yields one :class:`EngineOutput` per request it touched, and that same tuple is
the wire item of the worker's ``step_outputs`` message (a msgpack array in field order: compact,
one per request per step), so nothing is copied field by field between engine and broker.

Logprob entries (``EngineOutput.logprobs``, one per new token, when the request asked for them)::

    {"token_id": int, "logprob": float, "top": [[token_id, logprob], ...],   # top-n, best first
     "token": str, "top_tokens": [str, ...]}                                # their texts

``token`` texts are the engine's own (its detokenizer's tokenizer, special tokens kept), so the
edge never decodes a token to format logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["EngineOutput", "EngineRequest", "TextRequest", "label_logprobs"]


@dataclass(slots=True)
class EngineRequest:
    """One generation request as the engine takes it: the prompt as token ids.

    Attributes:
        request_id: unique among the requests an engine holds.
        prompt_token_ids: the prompt as the engine feeds it (chat template applied, tokenized
            once: at the edge, or by the worker's front end for a :class:`TextRequest`).
        sampling_params: ``SamplingParams`` or its wire dict (``SamplingParams.to_dict()``);
            the structured-output spec (``response_format``'s grammar) travels in it as
            ``structured_outputs``.
        lane: "interactive" or "batch".
        priority: lower is more urgent (within a lane).
        arrival_time: ``time.monotonic()`` seconds when the request reached this process (None:
            when the engine takes it).
        task: "generate", or "embed": prefill only, its final output carries the pooled hidden
            state (the worker's ``pooling_type``); sampling params are ignored.
        output_token_ids: tokens an earlier attempt already generated and sent (a request
            resumed after its worker was lost, broker/worker_side.py). The engine recomputes
            them with the prompt, as after a preemption, and goes on from there: they count
            against ``max_tokens``, their text is not sent again, the next output is the next
            token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None
    lane: str = "batch"
    priority: int = 0
    arrival_time: float | None = None
    task: str = "generate"
    output_token_ids: list[int] | None = None

    def prompt_fields(self) -> dict[str, Any]:
        """The prompt as the wire's keyword: ``{"prompt_token_ids": ...}``."""
        return {"prompt_token_ids": self.prompt_token_ids}


@dataclass(slots=True)
class TextRequest:
    """A request whose prompt is still text (``prompt``) or chat ``messages`` (exactly one):
    what a sender without a tokenizer submits. It travels as text; the worker's front end
    (``gpu_worker/prompt_encoder.py``) templates and tokenizes it and builds the
    :class:`EngineRequest` (fields as there), so no engine sees text."""

    request_id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    sampling_params: Any = None
    lane: str = "batch"
    priority: int = 0
    task: str = "generate"

    def prompt_fields(self) -> dict[str, Any]:
        """The one prompt form that is set, as the wire's keyword."""
        if self.messages is not None:
            return {"messages": self.messages}
        return {"prompt": self.prompt}


class EngineOutput(NamedTuple):
    """What one engine step produced for one request: a token delta, a final, or an error.

    ``new_token_ids`` may be non-empty while ``new_text`` is "" (text held back: an incomplete
    UTF-8 character or a possible stop string). ``finish_reason`` is "stop" | "length" | "abort"
    | "error" when ``finished``; ``metrics`` (the engine's timings and counts, ms) is set on the
    final output; ``error`` says what ended a request with "error". ``logprobs``: one entry per
    new token (module docstring) or None.

    ``prompt_logprobs`` (only when ``SamplingParams.prompt_logprobs`` is set, on the request's
    first token output, once): one entry per prompt position,
    ``{"token_id", "logprob", "rank", "top": [(token_id, logprob), ...]}``; position 0 has
    ``logprob`` and ``rank`` None and no top (nothing predicts it). Optional 9th wire item.

    ``embedding`` (embed requests, on the final output): the pooled, L2-normalized final hidden
    state as little-endian float32 bytes (``hidden_size`` x 4 bytes). Optional 10th wire item.
    """

    request_id: str
    new_text: str = ""
    new_token_ids: list[int] = []  # noqa: RUF012 - NamedTuple default, never mutated
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list | None = None
    metrics: dict | None = None
    error: str | None = None
    prompt_logprobs: list | None = None
    embedding: bytes | None = None


def label_logprobs(
    entries: Sequence[dict | None], token_text: Callable[[int], str]
) -> list[dict | None]:
    """Sampler logprob entries (``{"token_id", "logprob", "top": [(id, lp), ...]}``) with their
    tokens' texts added as ``token`` and ``top_tokens`` (module docstring); None stays None."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top_tokens = [token_text(pair[0]) for pair in e.get("top") or ()]
        out.append({**e, "token": token_text(e["token_id"]), "top_tokens": top_tokens})
    return out
