"""A request's life at the broker: its state, and what it ends with (final or error, timings).

Latency fields follow :mod:`laneserve.contracts.latency`: the broker composes them from the edge's hold
time (``Submit.edge_ms``, the edge's clock), its own monotonic intervals and the engine's delays
(the engine metrics dict, docs/interfaces.md "Engine metrics dict").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laneserve.broker import protocol as p
from laneserve.contracts import latency


@dataclass(slots=True)
class RequestState:
    """One request the broker holds, from ``submit`` to its final message.

    Times are the broker's ``time.monotonic()`` seconds unless named ``*_at`` (unix seconds).
    """

    submit: p.Submit
    client: bytes
    received: float  # broker monotonic seconds of the submit
    arrival_at: float  # unix seconds (display)
    worker: bytes | None = None
    worker_id: str | None = None  # the last worker it was dispatched to
    worker_model: str | None = None
    attempts: int = 0
    dispatched: float = 0.0
    first_token: float = 0.0  # monotonic, first content token seen at the broker
    sent_output: bool = False  # something was streamed to the client
    aborted: bool = False
    text: list[str] = field(default_factory=list)  # stream=False accumulation
    token_ids: list[int] = field(default_factory=list)  # every output token so far (resume)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # held for the Final, streamed or not
    embedding: bytes | None = None  # task "embed": the pooled vector of its final output
    num_tokens: int = 0
    lost: int = 0  # times its worker was lost and it was requeued (resumed or started again)
    solo: bool = False  # dispatched alone (its last attempt after a worker loss)

    @property
    def request_id(self) -> str:
        return self.submit.request_id

    @property
    def lane(self) -> str:
        return self.submit.lane

    @property
    def resumable(self) -> bool:
        """Another worker can go on from this request's output so far (`output_token_ids`):
        a generate request without a grammar (its matcher's state is not carried) whose
        sampling does not replay a seed (a fresh generator would draw other tokens)."""
        sp = self.submit.sampling_params
        seeded = sp.get("seed") is not None and sp.get("temperature", 1.0) != 0
        return self.submit.task == "generate" and not sp.get("structured_outputs") and not seeded

    def work(self) -> p.WorkRequest:
        """The message that dispatches this request's current attempt: a resumed one carries
        its output tokens so far and leaves its prompt logprobs out (they went out already)."""
        if not self.token_ids:
            return p.WorkRequest.of(self.submit, attempt=self.attempts)
        params = {k: v for k, v in self.submit.sampling_params.items() if k != "prompt_logprobs"}
        return p.WorkRequest.of(self.submit, self.attempts, list(self.token_ids), params)


def timings(req: RequestState, metrics: dict[str, Any], now: float) -> dict[str, float | None]:
    """The DESIGN per-phase fields in ms as far as the broker knows them, plus
    ``broker_wait_ms`` (arrival -> dispatch). ``now``: broker monotonic seconds of the finish.

    TTFT of a streamed request (or a resumed one: its first token came from an earlier attempt)
    is when its first content token passed the broker; otherwise it
    is the wait until dispatch plus the engine's own delay to the first token. The edge
    reports its own TTFT and e2e afterwards (``EdgeTimings``), which replace these in SQL.
    """
    edge_ms = req.submit.edge_ms  # arrival -> sent to the broker, on the edge's clock
    wait_ms = None
    if req.dispatched:
        wait_ms = edge_ms + latency.interval_ms(req.received, req.dispatched)
    if req.first_token and (req.submit.stream or req.lost):  # a resumed one's first came earlier
        ttft = latency.ttft_ms(edge_ms, latency.interval_ms(req.received, req.first_token))
    else:
        ttft = latency.ttft_ms(wait_ms, metrics.get("first_token_delay_ms"))
    return {
        "queue_ms": latency.queue_ms(wait_ms, metrics.get("first_scheduled_delay_ms")),
        "prefill_ms": metrics.get("prefill_ms"),
        "ttft_ms": ttft,
        "decode_ms": metrics.get("decode_ms"),
        "tpot_ms": metrics.get("tpot_ms"),
        "itl_p99_ms": metrics.get("itl_p99_ms"),
        "e2e_ms": latency.e2e_ms(edge_ms, latency.interval_ms(req.received, now)),
        "broker_wait_ms": wait_ms,
    }


def usage(req: RequestState, metrics: dict[str, Any]) -> dict[str, int | None]:
    """``Final.usage``: prompt, completion and cached token counts."""
    return {
        "prompt_tokens": metrics.get("prompt_tokens"),
        "completion_tokens": metrics.get("completion_tokens", req.num_tokens),
        "cached_tokens": metrics.get("cached_tokens"),
    }


def outcome(
    req: RequestState,
    finish_reason: str,
    error: tuple[str, str] | None,
    usage_: dict[str, int | None],
    timings_: dict[str, float | None],
    retryable: bool,
) -> p.Final | p.Error:
    """The message that ends ``req`` for its client: an ``Error`` when ``error`` (code,
    message) is given, else a ``Final`` carrying any accumulated (``stream=False``) output."""
    rid = req.request_id
    if error is not None:
        return p.Error(
            request_id=rid,
            code=error[0],
            message=error[1],
            retryable=retryable,
            attempts=req.attempts,
        )
    return p.Final(
        request_id=rid,
        finish_reason=finish_reason,
        usage=usage_,
        timings=timings_,
        text="".join(req.text),
        token_ids=[] if req.submit.stream else req.token_ids,
        logprobs=req.logprobs,
        worker_id=req.worker_id,
        attempts=req.attempts,
        prompt_logprobs=req.prompt_logprobs,
        embedding=req.embedding,
    )
