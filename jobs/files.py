"""Files of bulk jobs: rows in the `files` table, content under `$LANESERVE_HOME/files/`.

Input files are uploaded with purpose `"batch"`; the runner writes output and error files with
purpose `"batch_output"` (OpenAI's names). A file's content lives at `files.path` (absolute);
ids look like OpenAI's (`file-<hex>`). Writes go to a temporary file renamed into place, so a
reader never sees half a file.
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

from sqlalchemy import Engine

from db.models import File
from db.session import laneserve_home, read_session, write_session
from jobs.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from jobs.limits import MAX_FILE_BYTES

PURPOSES = ("batch", "batch_output")
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
        raise InvalidRequestError(f"purpose must be 'batch', got {purpose!r}")
    if not filename or len(filename) > 255:
        raise InvalidRequestError("filename must be 1..255 characters")
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
