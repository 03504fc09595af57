"""SQLAlchemy 2.0 models: the tables laneserve keeps in SQL.

Tables (see DESIGN.md "Storage"):

- `files`: uploaded and produced JSONL files (batch input, output and error files).
- `jobs`: one row per bulk job (an OpenAI "batch"), with a timestamp per status.
- `requests`: one row per request, API requests and job lines alike, with the per-phase
  latency fields of DESIGN.md "Per-phase latency" and, for job lines, the line's `body` and
  `response`.
- `worker_stats`: time series of worker snapshots (running, waiting, KV usage, ...).
- `retention_passes`: one row per pruning pass of the jobs runner, with its counts.
- `job_leases`: which jobs runner holds a job's control or a range of its lines, until when.

Conventions:

- Every `*_at` column is wall-clock **unix seconds** (float), for display and time-window
  queries only; durations are never computed from them (they come from monotonic intervals
  and are stored in the `*_ms` columns, in milliseconds).
- Lane values are `"interactive"` and `"batch"`.
- `requests.id` is the request id that clients see as the OpenAI response `id`
  (byte-equal).
- `jobs.request_counts` is stored as three integer columns `request_total`,
  `request_completed`, `request_failed`; the `Job.request_counts` property returns the
  OpenAI-shaped dict `{"total", "completed", "failed"}`.
- The job's free-form metadata lives in the column `metadata`, mapped to the attribute
  `Job.metadata_` (`metadata` is reserved by SQLAlchemy's declarative base).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# JSON on SQLite (stored as text), JSONB on PostgreSQL.
JSONType = JSON().with_variant(JSONB(), "postgresql")
# 64-bit autoincrement key; SQLite only autoincrements a column declared INTEGER.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")

# Deterministic constraint names so Alembic can drop them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

LANES = ("interactive", "batch")
JOB_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expired",
)
JOB_TERMINAL_STATUSES = ("completed", "failed", "cancelled", "expired")


class Base(DeclarativeBase):
    """Declarative base for every laneserve table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class File(Base):
    """A JSONL file known to the server (OpenAI `file` object).

    `bytes` is the size in bytes; `path` is where the content lives on disk (under
    `$LANESERVE_HOME`); `purpose` is `"batch"` for uploaded inputs and `"batch_output"` for
    produced output and error files. `job_id` is the job that produced the file (null for
    an uploaded input); it is a plain indexed column, not a foreign key, because a job
    references its input file before the output files exist.
    """

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    job_id: Mapped[str | None] = mapped_column(String(64), index=True)


class Job(Base):
    """A bulk job (OpenAI `batch` object); see DESIGN.md "Bulk jobs".

    `status` is one of `JOB_STATUSES`. Request counts are three columns
    (`request_total`, `request_completed`, `request_failed`); `request_counts` returns them
    as `{"total", "completed", "failed"}`. `input_file_id`/`output_file_id`/`error_file_id`
    reference `files.id` (the file row holds the path). `task` is the shorthand task
    (`"summarize"`, `"translate"`) or null for OpenAI Batch JSONL input. `errors` is the
    job-level error list (`[{"code", "message", "line"}]`), `metadata_` the user's
    metadata dict (column `metadata`), `owner` the API key name that created it (or null).
    Timestamps are unix seconds; `expires_at` is the deadline for `expired`.
    """

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(
        String(16), default="validating", server_default="validating"
    )
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(255))
    task: Mapped[str | None] = mapped_column(String(32))
    completion_window: Mapped[str] = mapped_column(String(16), default="24h", server_default="24h")
    input_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    request_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    request_completed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    request_failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    errors: Mapped[list[Any] | None] = mapped_column(JSONType)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType)
    owner: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float)
    finalizing_at: Mapped[float | None] = mapped_column(Float)
    completed_at: Mapped[float | None] = mapped_column(Float)
    failed_at: Mapped[float | None] = mapped_column(Float)
    cancelling_at: Mapped[float | None] = mapped_column(Float)
    cancelled_at: Mapped[float | None] = mapped_column(Float)
    expired_at: Mapped[float | None] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        Index("ix_jobs_created_at", "created_at"),
        Index("ix_jobs_status", "status"),
    )

    @property
    def request_counts(self) -> dict[str, int]:
        """`{"total", "completed", "failed"}` as in the OpenAI batch object."""
        return {
            "total": self.request_total or 0,
            "completed": self.request_completed or 0,
            "failed": self.request_failed or 0,
        }


class Request(Base):
    """One request (API request or job line) with its per-phase latency.

    `id` is the request id clients see as the OpenAI response id. For job lines `job_id`
    and `custom_id` are set (unique together), `line_no` is the 1-based input line, `body`
    the line's request body and `response` the response body once finished. `status` is
    free text owned by the writer (the recorder writes the broker's final status:
    `"completed"`, `"failed"`, `"aborted"`; the jobs runner may write `"pending"`,
    `"in_progress"` before). `attempts` counts dispatches lost to a worker.

    Latency fields are milliseconds, per DESIGN.md "Per-phase latency" (see
    `contracts.latency`), null when unknown; `tpot_ms` is null when
    `completion_tokens < 2`. Token counts are integers. `arrival_at`,
    `first_scheduled_at`, `first_token_at`, `finished_at` are unix seconds (display only).
    """

    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    custom_id: Mapped[str | None] = mapped_column(String(512))
    line_no: Mapped[int | None] = mapped_column(Integer)
    lane: Mapped[str] = mapped_column(
        String(16), default="interactive", server_default="interactive"
    )
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # the request's task: "generate", or "embed" (/v1/embeddings: prefill only, no TPOT)
    kind: Mapped[str] = mapped_column(String(16), default="generate", server_default="generate")
    model: Mapped[str | None] = mapped_column(String(255))
    worker_id: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str | None] = mapped_column(String(24))
    finish_reason: Mapped[str | None] = mapped_column(String(24))
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    preemptions: Mapped[int | None] = mapped_column(Integer)
    prefill_chunks: Mapped[int | None] = mapped_column(Integer)
    # speculative decoding: draft tokens verified / accepted (acceptance = accepted / draft) and
    # the verifications that carried drafts (mean accepted length = 1 + accepted / num_drafts)
    spec_draft_tokens: Mapped[int | None] = mapped_column(Integer)
    spec_accepted_tokens: Mapped[int | None] = mapped_column(Integer)
    spec_num_drafts: Mapped[int | None] = mapped_column(Integer)
    arrival_at: Mapped[float | None] = mapped_column(Float)
    first_scheduled_at: Mapped[float | None] = mapped_column(Float)
    first_token_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    queue_ms: Mapped[float | None] = mapped_column(Float)
    prefill_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    decode_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    itl_p99_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float | None] = mapped_column(Float)
    body: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSONType)

    __table_args__ = (
        UniqueConstraint("job_id", "custom_id", name="uq_requests_job_id_custom_id"),
        # Dashboard time windows: all lanes, or one lane, over [t0, t1).
        Index("ix_requests_arrival_at", "arrival_at"),
        Index("ix_requests_lane_arrival_at", "lane", "arrival_at"),
        Index("ix_requests_finished_at", "finished_at"),
        # ... by finished_at for one lane or one model, and the distinct models (migration 0005).
        Index("ix_requests_lane_finished_at", "lane", "finished_at"),
        Index("ix_requests_model_finished_at", "model", "finished_at"),
        # Jobs runner: the lines of one job by status.
        Index("ix_requests_job_id_status", "job_id", "status"),
    )


class WorkerStat(Base):
    """One worker snapshot (time series).

    `at` is unix seconds; `lanes` the comma-joined lanes the worker serves
    (`"interactive,batch"`); `running`/`waiting` request counts; `kv_usage` the fraction of
    KV blocks in use (0..1); `prefix_hit_rate` the fraction of prompt tokens served from the
    prefix cache (0..1); `step_ms` the mean engine step time in ms; `tokens_per_s` output
    tokens per second; `preemptions` the worker's cumulative preemption count.
    SLO-driven steps (null under fixed knobs): the targets `slo_{interactive,batch}_{ttft,tpot}_ms`
    (P99 ms), the attainment `slo_{interactive,batch}_attainment` (fraction of the lane's recent
    requests within both targets, 0..1), the last step's `step_token_budget` and
    `step_batch_tokens` (tokens), `predicted_step_ms` and `measured_step_ms` (the step-cost
    model's prediction vs the measured moving average).
    (`worker_id`, `at`) is unique so a resent snapshot is written once.
    """

    __tablename__ = "worker_stats"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(128))
    at: Mapped[float] = mapped_column(Float)
    lanes: Mapped[str | None] = mapped_column(String(64))
    running: Mapped[int | None] = mapped_column(Integer)
    waiting: Mapped[int | None] = mapped_column(Integer)
    kv_usage: Mapped[float | None] = mapped_column(Float)
    prefix_hit_rate: Mapped[float | None] = mapped_column(Float)
    step_ms: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    preemptions: Mapped[int | None] = mapped_column(Integer)
    slo_interactive_ttft_ms: Mapped[float | None] = mapped_column(Float)
    slo_interactive_tpot_ms: Mapped[float | None] = mapped_column(Float)
    slo_batch_ttft_ms: Mapped[float | None] = mapped_column(Float)
    slo_batch_tpot_ms: Mapped[float | None] = mapped_column(Float)
    slo_interactive_attainment: Mapped[float | None] = mapped_column(Float)
    slo_batch_attainment: Mapped[float | None] = mapped_column(Float)
    step_token_budget: Mapped[int | None] = mapped_column(Integer)
    step_batch_tokens: Mapped[int | None] = mapped_column(Integer)
    predicted_step_ms: Mapped[float | None] = mapped_column(Float)
    measured_step_ms: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("worker_id", "at", name="uq_worker_stats_worker_id_at"),
        Index("ix_worker_stats_at", "at"),
    )


class RetentionPass(Base):
    """One pruning pass of the jobs runner (`jobs.retention`): what it removed.

    `at` is unix seconds; `older_than_s` the retention window in seconds; `files` the files
    deleted (rows and content), `bytes` their total size in bytes; `lines` the job lines whose
    `body` and `response` were cleared; `jobs` the terminal jobs those lines belong to.
    """

    __tablename__ = "retention_passes"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    older_than_s: Mapped[float] = mapped_column(Float)
    files: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    lines: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    jobs: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    __table_args__ = (Index("ix_retention_passes_at", "at"),)


REQUEST_COLUMNS = frozenset(c.name for c in Request.__table__.columns)
WORKER_STAT_COLUMNS = frozenset(c.name for c in WorkerStat.__table__.columns) - {"id"}


class JobLease(Base):
    """An expiring claim of a jobs runner on part of a job (`jobs.leases`).

    `part` 0 is the job's control (validation, cancel, expiry, finalization); part k >= 1 is
    the line range `[(k-1)*lines_per_part + 1, k*lines_per_part]` (1-based line numbers,
    `lines_per_part` in the row so it never depends on the runner's version). `owner` is the
    runner id holding it (NULL: free), `expires_at` unix seconds when the claim lapses; `done`
    marks a line range whose every line has a result.
    """

    __tablename__ = "job_leases"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    lines_per_part: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    owner: Mapped[str | None] = mapped_column(String(255))
    expires_at: Mapped[float | None] = mapped_column(Float)
    done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    takeovers: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class StoredResponse(Base):
    """A stored Responses API answer (`POST /v1/responses` with `store`, the default).

    `owner` is the SHA-256 (hex) of the API key that created it: only that key can read it,
    delete it or continue it with `previous_response_id`. `input_items` is the whole
    conversation the response answered (the earlier turns' items, then its own `input` as
    items), `response` the `response` object as it was sent; the next turn's input is
    `input_items + response["output"] + its own input`.

    A background response (`background: true`) also keeps its create body in `request_body`
    and, while it is queued or in progress, the lease of the gateway process that runs it
    (`lease_owner`, its instance id; `lease_expires_at`, unix seconds, renewed by a heartbeat):
    a lapsed lease means that process died, and another gateway runs the body again. `runs`
    counts the times it was started (laneserve.api.response_leases).
    """

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    input_items: Mapped[Any] = mapped_column(JSONType)
    response: Mapped[Any] = mapped_column(JSONType)
    request_body: Mapped[Any | None] = mapped_column(JSONType)
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[float | None] = mapped_column(Float, index=True)
    runs: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
