"""Per-request engine state: lane, status, token ids, KV block table and phase timestamps.

One `Request` lives from `Scheduler.add_request` until it reaches a `FINISHED_*` status. The
scheduler owns the scheduling fields (`status`, `num_computed_tokens`, `num_cached_tokens`,
`num_preemptions`, `num_prefill_chunks`, `first_scheduled_time`), the block manager owns
`block_table` and `block_hashes`, and the engine appends sampled tokens with
`append_output_token_ids` (which records the token timestamps).

Token layout of one request (`num_tokens = num_prompt_tokens + num_output_tokens`)::

    all_token_ids:  [ prompt ......................... | outputs ......... ]
                    [0, num_computed_tokens)  KV in the cache (valid for reads)
                    [num_computed_tokens, num_tokens)  still to compute (at least 1 while running)

All times are `time.monotonic()` seconds (per-process, never compared across hosts); the
`*_ms` derived figures follow the per-phase definitions in DESIGN.md.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from laneserve.contracts import latency

__all__ = ["Lane", "Request", "RequestStatus"]


class Lane(enum.StrEnum):
    """Traffic class of a request; interactive ranks before batch everywhere in the engine."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """Scheduling rank: 0 for interactive, 1 for batch (lower is scheduled first)."""
        return 0 if self is Lane.INTERACTIVE else 1


class RequestStatus(enum.Enum):
    """Life cycle: WAITING -> RUNNING (<-> PREEMPTED -> RUNNING ...) -> FINISHED_*."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ("stop" | "length" | "abort" | "error"), None if unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # no slots: the engine may attach per-request state (detokenizer, ...)
class Request:
    """One generation request inside the engine (identity semantics: `eq=False`).

    Args:
        request_id: unique id within the engine.
        prompt_token_ids: prompt token ids (at least one; the engine validates length and
            `max_model_len` before `Scheduler.add_request`).
        sampling_params: the request's `SamplingParams` (opaque to the scheduler).
        lane: traffic class; interactive is scheduled first and may preempt batch.
        priority: lower value = more urgent (vLLM convention); ranks after the lane.
        arrival_time: `time.monotonic()` seconds when the engine accepted the request.
        cache_salt: optional string mixed into the first block's hash so requests with
            different salts never share prefix-cache blocks.
        pooling_type: "LAST" | "MEAN" for an embed request (prefill only: it ends when its
            prompt is computed, gpu_worker/pooling.py), None for a generating one.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None
    lane: Lane = Lane.BATCH
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    pooling_type: str | None = None
    num_resumed_tokens: int = 0  # output tokens an earlier attempt generated (EngineRequest)

    # --- scheduling state (owned by the scheduler) ---
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule (tokens); -1 = not yet
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # scheduled steps that computed prompt (or recomputed) tokens
    # speculative decoding: drafts the engine proposes for the next step (the scheduler sends
    # them after the last token when the request decodes), and the totals drafted / accepted
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_drafts: int = 0  # verifications that carried drafts

    # --- KV cache state (owned by the block manager) ---
    block_table: list[int] = field(default_factory=list)  # physical block ids, in order
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of full blocks so far

    # --- timestamps, time.monotonic() seconds ---
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_gaps_ms: list[float] = field(default_factory=list)  # gaps between output tokens (ms)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.lane = Lane(self.lane)

    # --- token views ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens (tokens)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output token ids (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without concatenating the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def sort_key(self) -> tuple[int, int, float]:
        """Scheduling order (ascending = first): lane rank, priority, arrival time."""
        return (self.lane.rank, self.priority, self.arrival_time)

    def metrics(self) -> dict[str, float | int | None]:
        """Engine-side per-phase figures (docs/interfaces.md "Engine metrics dict").

        Durations are ms from this process's monotonic clock, None when the phase did not
        happen (e.g. aborted before the first token): `queue_ms` (arrival -> first scheduled),
        `prefill_ms` (first scheduled -> first token), `decode_ms` (first -> last token),
        `tpot_ms` (decode_ms / (the tokens of this attempt - 1): a resumed request's
        `num_resumed_tokens` were decoded elsewhere; None below 2 tokens), `itl_p99_ms`
        (99th percentile of `token_gaps_ms`), all as `contracts.latency` defines them,
        `first_scheduled_delay_ms` and `first_token_delay_ms` (arrival at the engine -> first
        scheduled / first token); counts `prompt_tokens, cached_tokens, completion_tokens,
        preemptions, prefill_chunks, spec_draft_tokens, spec_accepted_tokens, spec_num_drafts`
        (speculative decoding's draft tokens verified and accepted, and the verifications that
        carried drafts: mean accepted length = 1 + accepted / num_drafts; 0 without it).
        """
        n_out = self.num_output_tokens
        decode_ms = latency.decode_ms(self.first_token_time, self.last_token_time)
        return {
            "queue_ms": latency.interval_ms(self.arrival_time, self.first_scheduled_time),
            "prefill_ms": latency.prefill_ms(self.first_scheduled_time, self.first_token_time),
            "decode_ms": decode_ms,
            "tpot_ms": latency.tpot_ms(decode_ms, n_out - self.num_resumed_tokens),
            "itl_p99_ms": latency.itl_p99_ms(self.token_gaps_ms),
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": min(max(self.num_cached_tokens, 0), self.num_prompt_tokens),
            "completion_tokens": n_out,
            "preemptions": self.num_preemptions,
            "prefill_chunks": self.num_prefill_chunks,
            "spec_draft_tokens": self.num_spec_draft_tokens,
            "spec_accepted_tokens": self.num_spec_accepted_tokens,
            "spec_num_drafts": self.num_spec_drafts,
            "first_scheduled_delay_ms": latency.interval_ms(
                self.arrival_time, self.first_scheduled_time
            ),
            "first_token_delay_ms": latency.interval_ms(self.arrival_time, self.first_token_time),
        }

    # --- engine hooks ---
    def append_output_token_ids(self, token_ids: int | list[int], now: float | None = None) -> None:
        """Append sampled token id(s) and record first/last token times and the gaps (ms).

        Args:
            token_ids: one id or a list of ids produced by one step.
            now: `time.monotonic()` seconds of the step; taken now when None.
        """
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if not token_ids:
            return
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.token_gaps_ms.append(latency.interval_ms(self.last_token_time, now))
        # Several tokens in one step arrive together: their gaps are 0 ms.
        self.token_gaps_ms.extend([0.0] * (len(token_ids) - 1))
        self.last_token_time = now
        self.output_token_ids.extend(token_ids)
