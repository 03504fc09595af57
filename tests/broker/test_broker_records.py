"""Finished-request records and worker snapshots: broker -> recorder link."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import ROOT, run

pytestmark = pytest.mark.slow


async def _three_requests(front: str, job_id: str | None = "job-1") -> None:
    async with BrokerClient(front) as c:
        async for _ in c.submit(request_id="api-1", prompt="hi", sampling_params={"max_tokens": 4}):
            pass
        it = c.submit(
            request_id="job-1-line-1",
            prompt="translate",
            lane="batch",
            stream=False,
            sampling_params={"max_tokens": 3},
            job_id=job_id,
            custom_id="line-1" if job_id else None,
        )
        async for _ in it:
            pass
        it = c.submit(request_id="api-2", prompt="long", sampling_params={"max_tokens": 5000})
        await anext(it)
        await it.aclose()  # aborted
        await asyncio.sleep(0.3)


def _recv_batch(sock: zmq.Socket, timeout_s: float) -> tuple[bytes, p.RecordBatch] | None:
    if not sock.poll(timeout_s * 1000):
        return None
    frames = sock.recv_multipart()
    return frames[0], p.decode(frames[1:], p.BROKER_TO_RECORDER)


def test_records_resent_until_acknowledged(stack) -> None:
    ctx = zmq.Context.instance()
    rec = ctx.socket(zmq.ROUTER)
    rec.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{stack.tmp}/rec.sock"
    rec.bind(addr)
    try:
        stack.start_broker(
            "--recorder", addr, "--record-resend", "0.5", "--snapshot-interval", "0.5"
        )
        stack.start_worker("w1", "--synthetic-step-ms", "2")
        stack.wait_workers({"w1"})
        run(_three_requests(stack.front))
        records: dict[str, p.RequestRecord] = {}
        snapshots: list[p.WorkerSnapshot] = []
        first_seq = None
        resent = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (len(records) == 3 and resent and snapshots):
            got = _recv_batch(rec, 1.0)
            if got is None:
                continue
            ident, batch = got
            for r in batch.records:
                records[r.request_id] = r
            snapshots += batch.snapshots
            if first_seq is None and batch.records:
                first_seq = batch.seq  # do not ack the first batch with records...
            elif batch.seq == first_seq:
                resent = True  # ...it comes back
                rec.send_multipart([ident, *p.RecordAck(seq=batch.seq).to_frames()])
            else:
                rec.send_multipart([ident, *p.RecordAck(seq=batch.seq).to_frames()])
        assert resent, "unacknowledged batch was not resent"
        assert set(records) == {"api-1", "job-1-line-1", "api-2"}, records
        for r in records.values():
            assert type(r) is p.RequestRecord
            assert r.worker_id == "w1" and r.attempts == 1 and r.model == "synthetic"
        api, job, aborted = records["api-1"], records["job-1-line-1"], records["api-2"]
        assert api.lane == "interactive" and api.status == "completed"
        assert api.completion_tokens == 4 and api.finish_reason == "length"
        assert 0 < api.ttft_ms <= api.e2e_ms and api.queue_ms >= 0
        assert api.queue_ms <= api.ttft_ms and api.tpot_ms is not None
        assert 0 < api.arrival_at <= time.time() and api.error_code is None
        assert api.job_id is None and api.custom_id is None
        assert job.lane == "batch" and job.job_id == "job-1" and job.custom_id == "line-1"
        assert aborted.status == "aborted" and aborted.finish_reason == "abort"
        assert snapshots and type(snapshots[0]) is p.WorkerSnapshot
        assert snapshots[0].worker_id == "w1" and snapshots[0].lanes == ["interactive", "batch"]
        # once acknowledged, nothing is resent
        time.sleep(1.2)
        while (got := _recv_batch(rec, 0.2)) is not None:
            assert not got[1].records, got[1]
            rec.send_multipart([got[0], *p.RecordAck(seq=got[1].seq).to_frames()])
        st = stack.status()
        assert st["queues"]["records_unacked"] <= 10  # snapshots only, in flight
    finally:
        rec.close()


def test_records_reach_sqlite_through_the_real_recorder(stack) -> None:
    db_path = stack.tmp / "ls.db"
    addr = f"ipc://{stack.tmp}/rec.sock"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(stack.tmp))
    log = open(stack.tmp / "recorder.log", "wb")  # noqa: SIM115
    recorder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "laneserve.cli",
            "recorder",
            "--recorder-addr",
            addr,
            "--db",
            f"sqlite:///{db_path}",
        ],
        stdout=log,
        stderr=log,
        env=env,
        cwd=ROOT,
    )
    try:
        stack.start_broker("--recorder", addr)
        stack.start_worker("w1", "--synthetic-step-ms", "2")
        stack.wait_workers({"w1"})
        run(_three_requests(stack.front, job_id=None))  # no jobs row: job_id would break the FK
        rows = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(rows) < 3:
            time.sleep(0.3)
            if not Path(db_path).exists():
                continue
            try:
                with sqlite3.connect(db_path) as conn:
                    rows = conn.execute(
                        "SELECT id, lane, worker_id, status, attempts, completion_tokens, ttft_ms FROM requests ORDER BY id"
                    ).fetchall()
            except sqlite3.OperationalError:
                rows = []  # migrations not applied yet
        assert len(rows) == 3, (
            f"rows {rows}; {Path(stack.tmp / 'recorder.log').read_text()[-2000:]}"
        )
        by_id = {r[0]: r for r in rows}
        assert by_id["api-1"][1:5] == ("interactive", "w1", "completed", 1)
        assert by_id["api-1"][5] == 4 and by_id["api-1"][6] > 0
        assert by_id["api-2"][3] == "aborted"
        assert by_id["job-1-line-1"][1:4] == ("batch", "w1", "completed")
        assert stack.wait_status(lambda s: s["queues"]["records_unacked"] == 0, timeout_s=10)

        # The edge's own TTFT/e2e (DESIGN: measured at the edge) replace the broker's estimates.
        async def report() -> None:
            async with BrokerClient(stack.front) as c:
                c.report_edge_timings("api-1", 123.25, 456.5)
                await asyncio.sleep(0.3)

        run(report())
        edge = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and edge != (123.25, 456.5):
            time.sleep(0.3)
            with sqlite3.connect(db_path) as conn:
                edge = conn.execute(
                    "SELECT ttft_ms, e2e_ms FROM requests WHERE id = 'api-1'"
                ).fetchone()
        assert edge == (123.25, 456.5)
    finally:
        recorder.terminate()
        recorder.wait(timeout=10)
        log.close()
