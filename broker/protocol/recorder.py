"""Broker <-> recorder messages: typed finished-request records and worker snapshots.

- broker -> recorder: ``record_batch`` (:class:`RequestRecord`, :class:`EdgeTimings` and
  :class:`WorkerSnapshot` items)
- recorder -> broker: ``record_ack``

The broker describes what happened in its own terms; the recorder (``db/recorder.py``) maps
these onto the ``requests`` and ``worker_stats`` rows, so no SQL column name crosses the link.
Times: ``*_at`` are unix seconds (display only), ``*_ms`` durations from monotonic intervals
(:mod:`laneserve.contracts.latency`).
"""

from __future__ import annotations

from typing import ClassVar

from laneserve.broker.protocol.base import Message, message, t_message
from laneserve.broker.protocol.checks import (
    ERROR_CODES,
    FINISH_REASONS,
    LANES,
    MAX_RECORDS,
    MAX_TEXT_CHARS,
    TASKS,
    ProtocolError,
    spec,
    t_float,
    t_int,
    t_list,
    t_opt,
    t_str,
)
from laneserve.broker.protocol.front import EdgeTimings

REQUEST_STATUSES = ("completed", "failed", "aborted")
"""A finished request's outcome: a final answer, an error, or an abort."""

_MS = t_opt(t_float(0.0, 1e10))  # a duration in ms (None: the phase did not happen)
_COUNT = t_opt(t_int(0, 2**31 - 1))  # a token or event count
_FRACTION = t_opt(t_float(0.0, 1.0))


@message
class RequestRecord(Message):
    """One finished request: identity, outcome, token counts and the DESIGN latency fields.

    ``arrival_at``: unix seconds when the edge accepted it (display). Durations in ms, None when
    the phase did not happen (aborted in the queue, no token). Token counts: ``prompt_tokens``,
    ``cached_tokens`` (prefix hits), ``completion_tokens``, ``preemptions``, ``prefill_chunks``,
    ``spec_draft_tokens`` / ``spec_accepted_tokens`` / ``spec_num_drafts`` (speculative decoding:
    draft tokens verified / accepted, and verifications that carried drafts).
    ``error_code`` (one of ERROR_CODES) and ``error_message`` are set when ``status`` is
    ``"failed"``. ``job_id``/``custom_id`` are set for bulk-job lines only. ``kind``: the
    request's task, ``"generate"`` or ``"embed"`` (prefill only: no decode, no TPOT).
    """

    KIND: ClassVar[str] = "request_record"
    request_id: str = spec(t_str())
    lane: str = spec(t_str(choices=LANES))
    status: str = spec(t_str(choices=REQUEST_STATUSES))
    finish_reason: str = spec(t_str(choices=FINISH_REASONS))
    attempts: int = spec(t_int(0, 1000))
    arrival_at: float = spec(t_float(0.0, 1e11))
    priority: int = spec(t_int(-(2**31), 2**31 - 1), 0)
    model: str | None = spec(t_opt(t_str()), None)
    worker_id: str | None = spec(t_opt(t_str()), None)
    error_code: str | None = spec(t_opt(t_str(choices=ERROR_CODES)), None)
    error_message: str | None = spec(t_opt(t_str(MAX_TEXT_CHARS)), None)
    prompt_tokens: int | None = spec(_COUNT, None)
    cached_tokens: int | None = spec(_COUNT, None)
    completion_tokens: int | None = spec(_COUNT, None)
    preemptions: int | None = spec(_COUNT, None)
    prefill_chunks: int | None = spec(_COUNT, None)
    spec_draft_tokens: int | None = spec(_COUNT, None)
    spec_accepted_tokens: int | None = spec(_COUNT, None)
    spec_num_drafts: int | None = spec(_COUNT, None)
    queue_ms: float | None = spec(_MS, None)
    prefill_ms: float | None = spec(_MS, None)
    ttft_ms: float | None = spec(_MS, None)
    decode_ms: float | None = spec(_MS, None)
    tpot_ms: float | None = spec(_MS, None)
    itl_p99_ms: float | None = spec(_MS, None)
    e2e_ms: float | None = spec(_MS, None)
    job_id: str | None = spec(t_opt(t_str()), None)
    custom_id: str | None = spec(t_opt(t_str(4096)), None)
    kind: str = spec(t_str(choices=TASKS), "generate")

    def validate(self) -> None:
        if not self.request_id:
            raise ProtocolError("request_record: empty request_id")
        if (self.error_code is None) != (self.status != "failed"):
            raise ProtocolError("request_record: error_code is set exactly when status is failed")


@message
class WorkerSnapshot(Message):
    """One worker's load at ``at`` (unix seconds): ``running``/``waiting`` request counts,
    ``kv_usage`` (fraction of KV blocks in use, 0..1), ``prefix_hit_rate`` (fraction of prompt
    tokens served from the prefix cache, 0..1), ``step_ms`` (mean engine step, ms),
    ``tokens_per_s`` (output tokens per second), ``preemptions`` (cumulative count). SLO-driven
    steps (gpu_worker/step_budget.py; None under fixed knobs): the lanes' targets
    ``slo_{lane}_{ttft,tpot}_ms`` (P99 ms), their attainment ``slo_{lane}_attainment`` (0..1),
    the last step's ``step_token_budget`` and ``step_batch_tokens`` (tokens), and the step-cost
    model's ``predicted_step_ms`` vs ``measured_step_ms``."""

    KIND: ClassVar[str] = "worker_snapshot"
    worker_id: str = spec(t_str())
    at: float = spec(t_float(0.0, 1e11))
    lanes: list = spec(t_list(t_str(choices=LANES), 2), [])
    running: int | None = spec(_COUNT, None)
    waiting: int | None = spec(_COUNT, None)
    kv_usage: float | None = spec(_FRACTION, None)
    prefix_hit_rate: float | None = spec(_FRACTION, None)
    step_ms: float | None = spec(_MS, None)
    tokens_per_s: float | None = spec(t_opt(t_float(0.0, 1e12)), None)
    preemptions: int | None = spec(_COUNT, None)
    slo_interactive_ttft_ms: float | None = spec(_MS, None)
    slo_interactive_tpot_ms: float | None = spec(_MS, None)
    slo_batch_ttft_ms: float | None = spec(_MS, None)
    slo_batch_tpot_ms: float | None = spec(_MS, None)
    slo_interactive_attainment: float | None = spec(_FRACTION, None)
    slo_batch_attainment: float | None = spec(_FRACTION, None)
    step_token_budget: int | None = spec(_COUNT, None)
    step_batch_tokens: int | None = spec(_COUNT, None)
    predicted_step_ms: float | None = spec(_MS, None)
    measured_step_ms: float | None = spec(_MS, None)


@message
class RecordBatch(Message):
    """Finished-request records, the edge's own TTFT/e2e for earlier records, and worker
    snapshots. ``seq`` increases per broker; the recorder answers ``RecordAck(seq)`` after its
    commit, and may see a batch twice (writes are idempotent). Within a batch the recorder
    applies ``records`` before ``edge_timings``."""

    KIND: ClassVar[str] = "record_batch"
    seq: int = spec(t_int(0))
    records: list = spec(t_list(t_message(RequestRecord), MAX_RECORDS), [])
    edge_timings: list = spec(t_list(t_message(EdgeTimings), MAX_RECORDS), [])
    snapshots: list = spec(t_list(t_message(WorkerSnapshot), MAX_RECORDS), [])

    def num_items(self) -> int:
        """Items carried (records, edge timings and snapshots)."""
        return len(self.records) + len(self.edge_timings) + len(self.snapshots)


@message
class RecordAck(Message):
    """The recorder committed the RecordBatch with this ``seq``."""

    KIND: ClassVar[str] = "record_ack"
    seq: int = spec(t_int(0))


BROKER_TO_RECORDER: tuple[type[Message], ...] = (RecordBatch,)
RECORDER_TO_BROKER: tuple[type[Message], ...] = (RecordAck,)
