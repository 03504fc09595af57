"""Library API of bulk jobs, used by the HTTP gateway (`/v1/files`, `/v1/batches`) and the CLI.

Every function takes a SQLAlchemy `Engine` (`db.session.make_engine(url)`; call
`db.migrate.upgrade(url)` once at start-up) and returns ORM rows detached from their session
(readable after return). Errors are `jobs.errors` types carrying `code` and `status_code`.

Files (`jobs.files`, re-exported here):

- `create_file(engine, data: bytes | BinaryIO, filename, purpose="batch") -> File`
  (`POST /v1/files`; `PayloadTooLargeError` 413 over 200 MB, `InvalidRequestError` 400)
- `get_file(engine, file_id) -> File`, `file_path(engine, file_id) -> Path`,
  `file_content(engine, file_id) -> bytes` (`GET /v1/files/{id}/content`; `NotFoundError` 404)
- `list_files(engine, purpose=None, limit=10000, after=None, order="desc")
  -> (list[File], has_more)` (`GET /v1/files`; `after` is the id of the last file of the
  previous page)
- `delete_file(engine, file_id)` (`DELETE /v1/files/{id}`: row and content; `ConflictError`
  409 while a job that has not ended uses the file)
- `file_object(row) -> dict` (the OpenAI `file` object)

Retention (`jobs.retention.prune`, run by the jobs runner) deletes old files and clears the
line bodies of jobs that ended long ago.

Batches:

- `create_batch(engine, input_file_id, endpoint, completion_window="24h", metadata=None, *,
  owner=None, task=None, task_options=None, model=None) -> Job` (`POST /v1/batches`): a job in
  status `validating`; the jobs runner validates it and runs it. `task` ("summarize" |
  "translate") marks the task shorthand input (`{"id", "text"}` lines); its options
  (`target_lang`, `source_lang`, `max_tokens`) are kept as strings in the job's metadata.
- `get_batch(engine, batch_id) -> Job` (`GET /v1/batches/{id}`)
- `list_batches(engine, limit=20, after=None, owner=None) -> list[Job]` (`GET /v1/batches`,
  newest first; `after` is the id of the last batch of the previous page)
- `cancel_batch(engine, batch_id) -> Job` (`POST /v1/batches/{id}/cancel`): status
  `cancelling`; the runner aborts what is in flight, keeps finished results and ends the job
  `cancelled`. `ConflictError` (409) when the batch already ended.
- `batch_object(job) -> dict` (the OpenAI `batch` object, `request_counts` included)
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from sqlalchemy import Engine, select, update

from laneserve.contracts.openai import Limits
from laneserve.db.models import JOB_TERMINAL_STATUSES, File, Job
from laneserve.db.session import read_session, write_session
from laneserve.jobs.errors import ConflictError, InvalidRequestError, NotFoundError
from laneserve.jobs.files import (  # noqa: F401 - re-exported API
    create_file,
    delete_file,
    file_content,
    file_object,
    file_path,
    get_file,
    keyset_order,
    list_files,
    rows_after,
)
from laneserve.jobs.limits import DEFAULT_COMPLETION_WINDOW, ENDPOINTS, TASKS
from laneserve.jobs.prompts import check_task_options

_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_WINDOW_UNIT_S = {"s": 1, "m": 60, "h": 3600}
TASK_OPTION_KEYS = ("target_lang", "source_lang", "max_tokens", "schema", "repetition_penalty")
MAX_METADATA_KEYS = 16  # OpenAI: up to 16 key-value pairs
MAX_METADATA_VALUE_CHARS = 512  # OpenAI: values up to 512 characters
CANCELLABLE = ("validating", "in_progress", "finalizing")


def parse_completion_window(window: str) -> float:
    """Seconds in a completion window such as "24h" (also "30m", "90s").

    Raises:
        InvalidRequestError: not `<N>s|m|h`.
    """
    match = _WINDOW_RE.match(window or "")
    if match is None:
        raise InvalidRequestError(
            f"completion_window must look like '24h' (or '<N>m', '<N>s'), got {window!r}",
            param="completion_window",
        )
    return int(match.group(1)) * _WINDOW_UNIT_S[match.group(2)]


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def _as_json(value: Any) -> str:
    """`value` as the caller wrote it in JSON (`true`, not Python's `True`), else its repr."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _check_task_max_tokens(value: Any, limit: int | None) -> None:
    """A task job's `max_tokens` option is a positive integer (or a string of one) within the
    per-request cap: the jobs runner validates every line with `Limits()`'s, and `limit` (the
    API's `--max-tokens-limit`) when lower. Before, any value was taken, and every line of the
    job then failed with the same error."""
    if value is None:
        return
    text = str(value).strip()
    if type(value) is bool or not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise InvalidRequestError(
            f"task option max_tokens must be a positive integer, got {_as_json(value)}",
            param="task_options.max_tokens",
        )
    cap = min(Limits().max_tokens_limit, limit or Limits().max_tokens_limit)
    if int(text) > cap:
        raise InvalidRequestError(
            f"task option max_tokens must be <= {cap}, got {int(text)}",
            param="task_options.max_tokens",
        )


def _check_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequestError(
            f"metadata must be a map of at most {MAX_METADATA_KEYS} pairs", param="metadata"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str) or len(key) > 64:
            raise InvalidRequestError(
                "metadata keys (<= 64 chars) and values must be strings", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:  # OpenAI's limit
            raise InvalidRequestError(
                f"metadata value of {key!r} is longer than {MAX_METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return dict(metadata)


def _check_task(task: str | None, endpoint: str, task_options: Any) -> None:
    """The task name, its endpoint and the type of its options.

    Raises:
        InvalidRequestError: unknown task, a task on another endpoint than chat completions,
            or `task_options` that is not an object.
    """
    if task is not None and task not in TASKS:
        raise InvalidRequestError(f"task must be one of {list(TASKS)}, got {task!r}", param="task")
    want = "/v1/embeddings" if task == "embed" else "/v1/chat/completions"
    if task is not None and endpoint != want:
        raise InvalidRequestError(f"task {task!r} jobs use the {want} endpoint", param="endpoint")
    if task_options is not None and not isinstance(task_options, dict):
        raise InvalidRequestError(
            f"task_options must be an object, got {_as_json(task_options)}", param="task_options"
        )


def _with_task_options(
    meta: dict[str, str] | None,
    task: str | None,
    task_options: dict[str, Any],
    max_tokens_limit: int | None,
) -> dict[str, str]:
    """`meta` with the task options added as strings (None values left out): the job keeps its
    task options in its metadata, one value per key.

    Raises:
        InvalidRequestError: options without a task, unknown options, a bad `max_tokens`
            option, or a metadata key that is also an option with another value.
    """
    if task is None:
        raise InvalidRequestError("task options given without a task", param="task_options")
    unknown = set(task_options) - set(TASK_OPTION_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown task options {sorted(unknown)}", param="task_options")
    _check_task_max_tokens(task_options.get("max_tokens"), max_tokens_limit)
    options = {k: str(v) for k, v in task_options.items() if v is not None}
    clash = sorted(k for k in options if k in (meta or {}) and meta[k] != options[k])
    if clash:
        raise InvalidRequestError(
            f"metadata key {clash[0]!r} is also a task option of this job, with another "
            "value; give it once, in task_options",
            param="metadata",
        )
    return dict(meta or {}) | options


def _add_job(engine: Engine, job: Job) -> None:
    """Insert `job` once its input file is known to exist with purpose "batch".

    Raises:
        NotFoundError: no file `job.input_file_id`.
        InvalidRequestError: the file's purpose is not "batch".
    """
    input_file_id = job.input_file_id
    with write_session(engine) as session:
        file = session.get(File, input_file_id)
        if file is None:
            raise NotFoundError(f"no file {input_file_id!r}")
        if file.purpose != "batch":
            raise InvalidRequestError(
                f"file {input_file_id!r} has purpose {file.purpose!r}; a batch input needs 'batch'",
                param="input_file_id",
            )
        session.add(job)


def create_batch(
    engine: Engine,
    input_file_id: str,
    endpoint: str,
    completion_window: str = DEFAULT_COMPLETION_WINDOW,
    metadata: dict[str, str] | None = None,
    *,
    owner: str | None = None,
    task: str | None = None,
    task_options: dict[str, Any] | None = None,
    model: str | None = None,
    max_tokens_limit: int | None = None,
) -> Job:
    """Create a batch (status `validating`) over an uploaded input file.

    `model` is the job's default model for lines that do not name one (and the model of task
    shorthand jobs); `max_tokens_limit` the caller's cap on a request's `max_tokens` (the API's
    `--max-tokens-limit`), which a task's `max_tokens` option must respect. Returns the new
    `jobs` row.

    Raises:
        InvalidRequestError: unknown endpoint or task, bad window or metadata, task options
            without a task, or an input file whose purpose is not "batch".
        NotFoundError: no file `input_file_id`.
    """
    if endpoint not in ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}", param="endpoint"
        )
    window_s = parse_completion_window(completion_window)
    meta = _check_metadata(metadata)
    _check_task(task, endpoint, task_options)
    if task_options:
        meta = _with_task_options(meta, task, task_options, max_tokens_limit)
    # refused here, not by the runner: the job would otherwise be created and then fail
    check_task_options(task, task_options or {})
    now = time.time()
    job = Job(
        id=new_batch_id(),
        status="validating",
        endpoint=endpoint,
        model=model,
        task=task,
        completion_window=completion_window,
        input_file_id=input_file_id,
        request_total=0,
        request_completed=0,
        request_failed=0,
        metadata_=meta,
        owner=owner,
        created_at=now,
        expires_at=now + window_s,
    )
    _add_job(engine, job)
    return job


def get_batch(engine: Engine, batch_id: str) -> Job:
    """The `jobs` row. Raises NotFoundError."""
    with read_session(engine) as session:
        job = session.get(Job, batch_id)
    if job is None:
        raise NotFoundError(f"no batch {batch_id!r}")
    return job


def list_batches(
    engine: Engine, limit: int = 20, after: str | None = None, owner: str | None = None
) -> list[Job]:
    """Batches newest first, at most `limit` (1..100), starting after the batch `after`.

    Raises:
        InvalidRequestError: `limit` out of range.
        NotFoundError: `after` names no batch.
    """
    if not 1 <= limit <= 100:
        raise InvalidRequestError("limit must be between 1 and 100", param="limit")
    query = select(Job).order_by(*keyset_order(Job, True)).limit(limit)
    if owner is not None:
        query = query.where(Job.owner == owner)
    with read_session(engine) as session:
        if after is not None:
            query = query.where(rows_after(session, Job, after, True, "batch"))
        return list(session.scalars(query))


def cancel_batch(engine: Engine, batch_id: str) -> Job:
    """Ask the runner to cancel: status `cancelling` (idempotent while cancelling).

    Raises:
        NotFoundError: no such batch.
        ConflictError: the batch already ended (completed, failed, cancelled, expired).
    """
    with write_session(engine) as session:
        result = session.execute(
            update(Job)
            .where(Job.id == batch_id, Job.status.in_(CANCELLABLE))
            .values(status="cancelling", cancelling_at=time.time())
        )
        job = session.get(Job, batch_id)
        if job is None:
            raise NotFoundError(f"no batch {batch_id!r}")
        if result.rowcount == 0 and job.status != "cancelling":
            raise ConflictError(f"batch {batch_id!r} is already {job.status}")
        session.refresh(job)
    return job


def batch_object(job: Job) -> dict[str, Any]:
    """The OpenAI `batch` object for a row (times as integer unix seconds, null when unset)."""

    def ts(value: float | None) -> int | None:
        return None if value is None else int(value)

    errors = None
    if job.errors:  # OpenAI's BatchError: code, line, message, param (each may be null)
        data = [{k: e.get(k) for k in ("code", "line", "message", "param")} for e in job.errors]
        errors = {"object": "list", "data": data}
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": job.endpoint,
        "errors": errors,
        "input_file_id": job.input_file_id,
        "completion_window": job.completion_window,
        "status": job.status,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "created_at": ts(job.created_at),
        "in_progress_at": ts(job.in_progress_at),
        "expires_at": ts(job.expires_at),
        "finalizing_at": ts(job.finalizing_at),
        "completed_at": ts(job.completed_at),
        "failed_at": ts(job.failed_at),
        "expired_at": ts(job.expired_at),
        "cancelling_at": ts(job.cancelling_at),
        "cancelled_at": ts(job.cancelled_at),
        "request_counts": job.request_counts,
        "metadata": job.metadata_,
        "model": job.model,
        "task": job.task,
    }


def is_terminal(status: str) -> bool:
    """True for completed, failed, cancelled, expired."""
    return status in JOB_TERMINAL_STATUSES
