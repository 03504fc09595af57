"""The disk fills (issue 52, item 2): SQLite (the embedded default) and the files directory on a
small tmpfs that the test fills under a running job, then frees.

Real processes: recorder, broker, one synthetic worker, jobs runner and the gateway, with
LANESERVE_HOME (the SQLite database and the files directory) on a 16 MiB tmpfs mounted by the
test (skipped where mounting is not allowed). Checked: while the disk is full, an upload gets
HTTP 507 `insufficient_storage` (OpenAI error shape), and for the 5 s the disk stays full the job
neither ends nor fails a line (the runner pauses where a write fails: result rows when SQLite has
no page left, at the latest the result files); once space returns the job completes with every
line once, SQLite's integrity check passes, no record was dropped and uploads work again.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy as sa

from tests.harness import Stack, chat_line, check_exactly_once, report, wait_for, write_jsonl

pytestmark = pytest.mark.slow

API_KEY = "disk-key-0123456789"
LINES, FULL_S = 20, 5.0  # lines of 20 tokens (0.5 s each, 2 at a time); seconds kept full


@contextlib.contextmanager
def small_tmpfs(size: str = "16m") -> Iterator[Path]:
    mnt = Path(tempfile.mkdtemp(prefix="lsfull", dir="/tmp"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def fill(mnt: Path) -> Path:
    """Write zeros to `mnt/filler` until the filesystem refuses (ENOSPC)."""
    filler = mnt / "filler"
    chunk = b"\0" * (64 * 1024)
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with contextlib.suppress(OSError), filler.open("ab", buffering=0) as f:
        while True:  # the last partial chunk
            f.write(b"\0" * 512)
    return filler


def test_disk_full_under_a_job_then_space_returns() -> None:
    from laneserve.db.session import make_engine

    with small_tmpfs() as home:
        tmp = Path(tempfile.mkdtemp(prefix="lsf", dir="/tmp"))
        stack = Stack(tmp, home=home, liveness=25, api_key=API_KEY, own_tmp=True)
        engine = None
        try:
            stack.start_recorder()
            stack.start_broker("--recorder", stack.recorder_addr, "--record-resend", "1.0")
            stack.start_worker("w1", "--synthetic-step-ms", "25", "--max-num-seqs", "8")
            stack.start_jobs_runner("--max-in-flight", "2")
            stack.start_api()
            stack.wait_workers({"w1"})
            stack.wait_api()
            engine = make_engine(stack.db_url)
            client = openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)
            ids = [f"d{i:03d}" for i in range(LINES)]
            path = write_jsonl(tmp / "in.jsonl", [chat_line(c, f"t {c}", 20) for c in ids])
            file = client.files.create(file=path.open("rb"), purpose="batch")
            batch = client.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_for(
                lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3,
                60,
                "progress",
            )
            filler = fill(home)
            t_full = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                client.files.create(file=path.open("rb"), purpose="batch")
            assert refused.value.status_code == 507, refused.value
            assert refused.value.body["code"] == "insufficient_storage", refused.value.body
            statuses = set()  # what the job showed while the disk stayed full
            while time.monotonic() - t_full < FULL_S:
                job = client.batches.retrieve(batch.id)
                statuses.add(job.status)
                assert job.request_counts.failed == 0, job
                time.sleep(0.2)
            assert statuses <= {"in_progress", "finalizing"}, statuses  # paused, not ended
            assert "the disk is full" in stack.log("jobs-runner")
            done_while_full = job.request_counts.completed
            filler.unlink()  # space returns
            job = wait_for(
                lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
                90,
                "the job to complete",
            )
            assert job.request_counts.completed == LINES and job.request_counts.failed == 0
            out, err = check_exactly_once(engine, job, ids)
            assert not err and all(line["response"]["status_code"] == 200 for line in out)
            with engine.connect() as conn:
                assert conn.execute(sa.text("PRAGMA integrity_check")).scalar_one() == "ok"
            wait_for(
                lambda: stack.status()["queues"]["records_unacked"] == 0, 30, "records written"
            )
            assert stack.status()["counters"].get("records_dropped", 0) == 0
            r = httpx.post(
                stack.url + "/v1/files",
                headers={"Authorization": f"Bearer {API_KEY}"},
                files={"file": ("again.jsonl", path.read_bytes())},
                data={"purpose": "batch"},
                timeout=30,
            )
            assert r.status_code == 200, r.text  # uploads work again
            report(
                "disk full",
                lines=LINES,
                full_s=FULL_S,
                statuses_while_full=sorted(statuses),
                completed_while_full=done_while_full,
                duplicates=0,
                missing=0,
            )
        finally:
            stack.stop()
            if engine is not None:
                engine.dispose()
