"""Files of bulk jobs: rows in the `files` table, content under `$LANESERVE_HOME/files/`.

Input files are uploaded with purpose `"batch"`; the runner writes output and error files with
purpose `"batch_output"` (OpenAI's names). A file's content lives at `files.path` (absolute);
ids look like OpenAI's (`file-<hex>`). Writes go to a temporary file renamed into place, so a
reader never sees half a file.

A file is deleted (`delete_file`, or by the retention pass of `jobs.retention`) with its row and
its content; jobs that referenced it keep their row with the reference set to null. A file that
a job which has not ended uses (as its input, or as the output it is producing) is never
deleted: `delete_file` answers `ConflictError` (409).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session

from laneserve.db.models import JOB_TERMINAL_STATUSES, File, Job
from laneserve.db.session import laneserve_home, read_session, write_session
from laneserve.jobs.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from laneserve.jobs.limits import MAX_FILE_BYTES

PURPOSES = ("batch", "batch_output")
LIST_LIMIT_MAX = 10_000  # OpenAI's maximum (and default) page size of GET /v1/files
ORDERS = ("asc", "desc")
_COPY_CHUNK = 1 << 20


def files_dir() -> Path:
    """`$LANESERVE_HOME/files` (created on demand)."""
    path = laneserve_home() / "files"
    path.mkdir(parents=True, exist_ok=True)
    return path


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def derived_file_id(job_id: str, kind: str) -> str:
    """Deterministic id of a job's `kind` ("output" | "error") file, so a finalization that is
    redone after a crash overwrites the same row instead of adding one."""
    return "file-" + hashlib.sha256(f"{job_id}/{kind}".encode()).hexdigest()[:32]


def _write_atomic(dest: Path, data: bytes | BinaryIO, max_bytes: int | None) -> int:
    """Write `data` to `dest` through a temporary file; return the size in bytes.

    Raises:
        PayloadTooLargeError: more than `max_bytes` bytes (nothing is left on disk).
    """
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".upload-")
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            if isinstance(data, bytes | bytearray | memoryview):
                size = len(data)
                if max_bytes is not None and size > max_bytes:
                    raise PayloadTooLargeError(f"file is {size} bytes; the limit is {max_bytes}")
                out.write(data)
            else:
                while chunk := data.read(_COPY_CHUNK):
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise PayloadTooLargeError(f"file exceeds the limit of {max_bytes} bytes")
                    out.write(chunk)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def create_file(
    engine: Engine,
    data: bytes | BinaryIO,
    filename: str,
    purpose: str = "batch",
    *,
    max_bytes: int = MAX_FILE_BYTES,
) -> File:
    """Store an uploaded file (bytes, or a binary file object read in 1 MiB chunks).

    Returns the `files` row (`id`, `bytes`, `path`, ...).

    Raises:
        InvalidRequestError: `purpose` is not "batch" (uploads are batch inputs) or no filename.
        PayloadTooLargeError: more than `max_bytes` bytes (default 200 MB).
    """
    if purpose != "batch":
        raise InvalidRequestError(f"purpose must be 'batch', got {purpose!r}", param="purpose")
    if not filename or len(filename) > 255:
        raise InvalidRequestError("filename must be 1..255 characters", param="file")
    file_id = new_file_id()
    path = files_dir() / f"{file_id}.jsonl"
    size = _write_atomic(path, data, max_bytes)
    row = File(
        id=file_id,
        purpose=purpose,
        filename=os.path.basename(filename),
        bytes=size,
        path=str(path),
        created_at=time.time(),
    )
    try:
        with write_session(engine) as session:
            session.add(row)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return row


def put_output_file(engine: Engine, job_id: str, kind: str, src: Path) -> File:
    """Move a finished output/error file `src` into the store as the job's `kind` file
    (`"output"` or `"error"`, purpose `"batch_output"`); idempotent (same id on a redo)."""
    assert kind in ("output", "error"), kind
    file_id = derived_file_id(job_id, kind)
    dest = files_dir() / f"{file_id}.jsonl"
    os.replace(src, dest)
    with write_session(engine) as session:
        row = session.get(File, file_id) or File(id=file_id)
        row.purpose = "batch_output"
        row.filename = f"{job_id}_{kind}.jsonl"
        row.bytes = dest.stat().st_size
        row.path = str(dest)
        row.created_at = row.created_at or time.time()
        row.job_id = job_id
        session.add(row)
    return row


def get_file(engine: Engine, file_id: str) -> File:
    """The `files` row. Raises NotFoundError."""
    with read_session(engine) as session:
        row = session.get(File, file_id)
    if row is None:
        raise NotFoundError(f"no file {file_id!r}")
    return row


def file_path(engine: Engine, file_id: str) -> Path:
    """Where the file's content is on disk. Raises NotFoundError (no row, or content gone)."""
    row = get_file(engine, file_id)
    path = Path(row.path)
    if not path.exists():
        raise NotFoundError(f"content of file {file_id!r} is gone ({path})")
    return path


def file_content(engine: Engine, file_id: str) -> bytes:
    """The whole content (bytes). Raises NotFoundError. For large files prefer `file_path`."""
    return file_path(engine, file_id).read_bytes()


def copy_file_content(engine: Engine, file_id: str, dest: Path) -> int:
    """Copy the content to `dest`; return bytes copied. Raises NotFoundError."""
    src = file_path(engine, file_id)
    shutil.copyfile(src, dest)
    return dest.stat().st_size


def keyset_order(model, descending: bool) -> tuple:
    """ORDER BY of keyset pagination over a table with `created_at` and a unique `id`."""
    if descending:
        return model.created_at.desc(), model.id.desc()
    return model.created_at, model.id


def keyset_after(model, created_at: float, row_id: str, descending: bool):
    """WHERE of the rows that follow (`created_at`, `row_id`) in `keyset_order`."""
    if descending:
        return (model.created_at < created_at) | (
            (model.created_at == created_at) & (model.id < row_id)
        )
    return (model.created_at > created_at) | (
        (model.created_at == created_at) & (model.id > row_id)
    )


def rows_after(session: Session, model, row_id: str, descending: bool, noun: str):
    """WHERE of the rows after row `row_id` (a page's last id) in `keyset_order`.

    Raises:
        NotFoundError: no row `row_id` ("no {noun} ...").
    """
    anchor = session.get(model, row_id)
    if anchor is None:
        raise NotFoundError(f"no {noun} {row_id!r}")
    return keyset_after(model, anchor.created_at, anchor.id, descending)


def list_files(
    engine: Engine,
    purpose: str | None = None,
    limit: int = LIST_LIMIT_MAX,
    after: str | None = None,
    order: str = "desc",
) -> tuple[list[File], bool]:
    """Files by `created_at` (`order` "desc", newest first, or "asc"), at most `limit`
    (1..10000), only those of `purpose` when given, starting after the file `after` (the
    last id of the previous page). Returns (files, whether more follow).

    Raises:
        InvalidRequestError: `limit` out of range or `order` not "asc"/"desc".
        NotFoundError: `after` names no file.
    """
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequestError(f"limit must be between 1 and {LIST_LIMIT_MAX}", param="limit")
    if order not in ORDERS:
        raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    descending = order == "desc"
    query = select(File).order_by(*keyset_order(File, descending))
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    with read_session(engine) as session:
        if after is not None:
            query = query.where(rows_after(session, File, after, descending, "file"))
        rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def live_jobs_using(session: Session, file_ids: list[str]) -> dict[str, str]:
    """{file id: id of a job that has not ended and reads (input) or writes (output) it}."""
    if not file_ids:
        return {}
    live = Job.status.not_in(JOB_TERMINAL_STATUSES)
    rows = session.execute(
        select(Job.input_file_id, Job.id).where(live, Job.input_file_id.in_(file_ids))
    ).all()
    rows += session.execute(
        select(File.id, Job.id).join(Job, Job.id == File.job_id).where(live, File.id.in_(file_ids))
    ).all()
    return {file_id: job_id for file_id, job_id in rows}


def remove_files(session: Session, rows: list[File]) -> int:
    """Delete `rows` (content on disk, then the rows) inside the caller's write transaction;
    null the references of jobs to them. Returns the bytes freed. The caller has checked that
    no job that has not ended uses them (`live_jobs_using`).

    Content goes first: when the transaction then fails, the row stays with its content gone
    (`file_path` answers 404) and the next delete or pass removes it.
    """
    if not rows:
        return 0
    ids = [row.id for row in rows]
    freed = 0
    for row in rows:
        path = Path(row.path)
        if path.exists():
            freed += path.stat().st_size
        path.unlink(missing_ok=True)
    for column in (Job.input_file_id, Job.output_file_id, Job.error_file_id):
        session.execute(update(Job).where(column.in_(ids)).values({column.key: None}))
    session.execute(delete(File).where(File.id.in_(ids)))
    return freed


def delete_file(engine: Engine, file_id: str) -> None:
    """Delete a file: its row and its content (`DELETE /v1/files/{id}`).

    Raises:
        NotFoundError: no file `file_id`.
        ConflictError: a job that has not ended uses the file (its input, or the output file
            it is finalizing); cancel the job or wait for it to end.
    """
    with write_session(engine) as session:
        row = session.get(File, file_id)
        if row is None:
            raise NotFoundError(f"no file {file_id!r}")
        job_id = live_jobs_using(session, [file_id]).get(file_id)
        if job_id is not None:
            status = session.scalar(select(Job.status).where(Job.id == job_id))
            raise ConflictError(
                f"file {file_id!r} is in use by batch {job_id!r} ({status}); "
                "cancel the batch or wait until it ends, then delete the file"
            )
        remove_files(session, [row])


def file_object(row: File) -> dict:
    """The OpenAI `file` object for a row."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
    }
