"""`laneserve submit` while the API is away: the upload and the job creation are sent again (saying
so on stderr, as ``--wait`` does) until the API answers, for at most ``--timeout`` seconds.

Real processes on 127.0.0.1: the CLI is started first, against a port nothing listens on yet
(connection refused); then broker, one synthetic worker, jobs runner and gateway (SQLite) start on
that port. The CLI uploads, creates the job and follows it to ``completed`` (exit 0), every line
once. With ``--timeout 1`` and no API at all it gives up (exit 2) within a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.harness import (
    API_KEY,
    ROOT,
    Stack,
    chat_line,
    check_exactly_once,
    job_state,
    write_jsonl,
)

pytestmark = pytest.mark.slow


def _submit(stack: Stack, path: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(stack.home))
    args = ["submit", str(path), "--url", stack.url, "--api-key", API_KEY, *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "laneserve.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=stack.tmp,
    )  # fmt: skip


def test_submit_rides_out_an_api_that_is_not_up_yet(smollm2_gguf) -> None:
    stack = Stack(Path(tempfile.mkdtemp(prefix="lss", dir="/tmp")), api_key=API_KEY, own_tmp=True)
    try:
        ids = [f"s{i}" for i in range(4)]
        path = write_jsonl(stack.tmp / "in.jsonl", [chat_line(c, f"t {c}") for c in ids])
        started = time.monotonic()
        gives_up = _submit(stack, path, "--timeout", "1")
        _, err = gives_up.communicate(timeout=60)
        assert gives_up.returncode == 2 and "cannot reach" in err, err
        assert "still waiting, retrying" in err
        assert time.monotonic() - started < 30

        submitter = _submit(stack, path, "--wait", "--timeout", "120")
        time.sleep(1.0)  # it is retrying: connection refused
        assert submitter.poll() is None
        stack.start_broker()
        stack.start_worker("w1")
        stack.start_jobs_runner()
        stack.start_api("--model", str(smollm2_gguf), "--served-model-name", "smollm2")
        out, err = submitter.communicate(timeout=180)
        assert submitter.returncode == 0, err
        assert "still waiting, retrying" in err and "answers again after" in err, err
        engine = sa.create_engine(stack.db_url)
        job = job_state(engine, out.strip().splitlines()[0])
        assert job.status == "completed"
        check_exactly_once(engine, job, ids)
        engine.dispose()
    finally:
        stack.stop()
