"""What an engine step hands to its driver (torch-free, shared by `LLMEngine` and the synthetic
engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one request (docs/interfaces.md).

    `new_token_ids` may be non-empty while `new_text` is "" (text held back: an incomplete UTF-8
    character or a possible stop string). `metrics` (the engine metrics dict, ms) is set on the
    final delta; `finish_reason` is "stop" | "length" | "abort" | "error" when `finished`.
    """

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list | None = None
    metrics: dict | None = None
    error: str | None = None
