"""Recorder: idempotent batched writes, the ZMQ server, and crash safety of the process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa
import zmq

from laneserve.broker.protocol import (
    EdgeTimings,
    RecordAck,
    RecordBatch,
    RequestRecord,
    WorkerSnapshot,
    decode,
)
from laneserve.contracts import latency
from laneserve.db.models import Job, Request, WorkerStat
from laneserve.db.recorder import RecorderServer, batch_rows, prune, write_batch
from laneserve.db.session import make_engine, read_session, write_session


def _record(i: int, **extra) -> dict:
    return {
        "id": f"chatcmpl-{i}",
        "lane": "interactive" if i % 2 else "batch",
        "model": "smollm2",
        "status": "completed",
        "finish_reason": "stop",
        "prompt_tokens": 10 + i,
        "completion_tokens": 5,
        "arrival_at": 1_700_000_000.0 + i,
        "finished_at": 1_700_000_001.0 + i,
        "ttft_ms": 12.5,
        "e2e_ms": 40.0,
        **extra,
    }


def _snapshot(worker: str, at: float) -> dict:
    return {
        "worker_id": worker,
        "lanes": ["interactive", "batch"],
        "running": 3,
        "waiting": 1,
        "kv_usage": 0.25,
        "prefix_hit_rate": 0.5,
        "step_ms": 8.0,
        "tokens_per_s": 120.0,
        "preemptions": 0,
        "at": at,
    }


def _rec(i: int, **extra) -> RequestRecord:
    """The typed record the broker sends for `_record(i)`."""
    fields = {
        "request_id": f"chatcmpl-{i}",
        "lane": "interactive" if i % 2 else "batch",
        "model": "smollm2",
        "status": "completed",
        "finish_reason": "stop",
        "attempts": 1,
        "arrival_at": 1_700_000_000.0 + i,
        "prompt_tokens": 10 + i,
        "completion_tokens": 5,
        "ttft_ms": 12.5,
        "e2e_ms": 40.0,
    }
    return RequestRecord.checked(**(fields | extra))


def _snap(worker: str, at: float) -> WorkerSnapshot:
    fields = {k: v for k, v in _snapshot(worker, at).items()}
    return WorkerSnapshot.checked(**fields)


def _count(engine, model) -> int:
    with read_session(engine) as s:
        return s.scalar(sa.select(sa.func.count()).select_from(model))


def _add_job(engine, job_id="batch_1"):
    with write_session(engine) as s:
        s.add(Job(id=job_id, endpoint="/v1/chat/completions", created_at=time.time()))


def test_write_batch_is_idempotent(engine):
    records = [_record(i) for i in range(50)]
    snaps = [_snapshot("w0", 1.0), _snapshot("w1", 1.0)]
    first = write_batch(engine, records, snaps)
    assert (first.records_written, first.snapshots_written) == (50, 2)
    again = write_batch(engine, records + records[:3], snaps + snaps)  # resend, duplicates
    assert again.records_failed == 0 and again.snapshots_failed == 0
    assert _count(engine, Request) == 50 and _count(engine, WorkerStat) == 2
    with read_session(engine) as s:
        assert s.get(Request, "chatcmpl-7").prompt_tokens == 17
        assert s.scalars(sa.select(WorkerStat.lanes)).first() == "interactive,batch"


def test_job_line_record_updates_the_runner_row(engine):
    _add_job(engine)
    with write_session(engine) as s:  # the jobs runner's row before dispatch
        s.add(Request(id="req-a", job_id="batch_1", custom_id="a", lane="batch", body={"x": 1}))
        s.add(Request(id="req-b", job_id="batch_1", custom_id="b", lane="batch", body={"y": 2}))
    done = {"job_id": "batch_1", "lane": "batch", "status": "completed", "response": {"ok": True}}
    # Same id: plain upsert. Different id for an existing (job_id, custom_id): updated in place.
    result = write_batch(
        engine,
        [{"id": "req-a", "custom_id": "a", **done}, {"id": "req-z", "custom_id": "b", **done}],
        [],
    )
    assert result.records_written == 2 and result.records_failed == 0
    with read_session(engine) as s:
        a, b = s.get(Request, "req-a"), s.get(Request, "req-b")
        assert a.body == {"x": 1} and a.response == {"ok": True} and a.status == "completed"
        assert b.body == {"y": 2} and b.response == {"ok": True}
        assert s.get(Request, "req-z") is None


def test_bad_items_are_counted_and_the_rest_written(engine):
    records = [
        _record(1),
        {"lane": "batch"},  # no id
        _record(2, prompt_tokens="many"),  # wrong type
        _record(3, job_id="no-such-job", custom_id="x"),  # foreign key violation
        _record(4),
    ]
    snaps = [_snapshot("w0", 2.0), {"worker_id": "w1"}, _snapshot("w2", float("nan"))]
    result = write_batch(engine, records, snaps)
    assert (result.records_written, result.records_failed) == (2, 3)
    assert (result.snapshots_written, result.snapshots_failed) == (1, 2)
    with read_session(engine) as s:
        assert set(s.scalars(sa.select(Request.id))) == {"chatcmpl-1", "chatcmpl-4"}


def test_prune_by_age(engine):
    _add_job(engine)
    now = 1_800_000_000.0
    old, new = now - 10 * 86400, now - 3600
    write_batch(
        engine,
        [
            {"id": "old", "finished_at": old},
            {"id": "old-unfinished", "arrival_at": old},
            {"id": "new", "finished_at": new},
            {"id": "old-job-line", "job_id": "batch_1", "custom_id": "a", "finished_at": old},
        ],
        [_snapshot("w0", old), _snapshot("w0", new)],
    )
    assert prune(engine, 7 * 86400, now=now) == (2, 1)
    with read_session(engine) as s:
        assert set(s.scalars(sa.select(Request.id))) == {"new", "old-job-line"}
    assert prune(engine, 7 * 86400, now=now, include_job_lines=True) == (1, 0)
    with pytest.raises(ValueError):
        prune(engine, -1)


def test_typed_records_map_onto_rows_with_the_latency_fields(engine):
    """A hand-worked timeline (contracts.latency) stored through the typed record: every DESIGN
    field lands in its column, display timestamps are arrival_at + the field."""
    tokens = [500.22, 500.24, 500.27, 500.29, 500.42]  # engine clock, s
    decode_ms = latency.decode_ms(tokens[0], tokens[-1])
    gaps = [latency.interval_ms(a, b) for a, b in zip(tokens, tokens[1:], strict=False)]
    timings = {
        "queue_ms": latency.queue_ms(30.0, latency.interval_ms(500.0, 500.02)),
        "prefill_ms": latency.prefill_ms(500.02, tokens[0]),
        "ttft_ms": latency.ttft_ms(0.0, 260.0),
        "decode_ms": decode_ms,
        "tpot_ms": latency.tpot_ms(decode_ms, len(tokens)),
        "itl_p99_ms": latency.itl_p99_ms(gaps),
        "e2e_ms": latency.e2e_ms(0.0, 460.0),
    }
    expected = {
        "queue_ms": 50.0,
        "prefill_ms": 200.0,
        "ttft_ms": 260.0,
        "decode_ms": 200.0,
        "tpot_ms": 50.0,
        "itl_p99_ms": 127.0,
        "e2e_ms": 460.0,
    }
    failed = _rec(
        1,
        completion_tokens=len(tokens),
        status="failed",
        finish_reason="error",
        error_code="worker_lost",
        error_message="worker lost 3 times",
        **timings,
    )
    job = _rec(2, job_id="batch_1", custom_id="line-7", priority=3)
    rows, snaps = batch_rows(
        [RecordBatch(seq=1, records=[failed, job], snapshots=[_snap("w", 9.0)])]
    )
    _add_job(engine)
    result = write_batch(engine, rows, snaps)
    assert (result.records_written, result.snapshots_written) == (2, 1), result.errors
    with read_session(engine) as s:
        row = s.get(Request, "chatcmpl-1")
        assert {k: getattr(row, k) for k in expected} == pytest.approx(expected)
        assert row.error == "worker_lost: worker lost 3 times" and row.status == "failed"
        assert row.first_scheduled_at == pytest.approx(1_700_000_001.0 + 0.050)
        assert row.first_token_at == pytest.approx(1_700_000_001.0 + 0.260)
        assert row.finished_at == pytest.approx(1_700_000_001.0 + 0.460)
        assert row.job_id is None and row.custom_id is None and row.completion_tokens == 5
        line = s.get(Request, "chatcmpl-2")
        assert (line.job_id, line.custom_id, line.priority, line.error) == (
            "batch_1",
            "line-7",
            3,
            None,
        )
        snap = s.scalars(sa.select(WorkerStat)).one()
        assert (snap.worker_id, snap.at, snap.lanes, snap.kv_usage) == (
            "w",
            9.0,
            "interactive,batch",
            0.25,
        )


def test_job_line_record_keeps_the_runner_columns(engine):
    """A record without job_id/custom_id does not null the runner's columns of its row."""
    _add_job(engine)
    with write_session(engine) as s:
        s.add(
            Request(id="chatcmpl-4", job_id="batch_1", custom_id="a", lane="batch", body={"x": 1})
        )
    rows, _ = batch_rows([RecordBatch(seq=1, records=[_rec(4)])])
    assert "job_id" not in rows[0] and "body" not in rows[0]
    write_batch(engine, rows, [])
    with read_session(engine) as s:
        row = s.get(Request, "chatcmpl-4")
        assert (row.job_id, row.custom_id, row.body, row.status) == (
            "batch_1",
            "a",
            {"x": 1},
            "completed",
        )


def test_edge_timings_refine_the_record_in_the_same_and_a_later_batch(engine):
    edge = EdgeTimings(request_id="chatcmpl-1", ttft_ms=20.25, e2e_ms=None)
    rows, _ = batch_rows([RecordBatch(seq=1, records=[_rec(1)], edge_timings=[edge])])
    write_batch(engine, rows, [])
    with read_session(engine) as s:
        row = s.get(Request, "chatcmpl-1")
        assert (row.ttft_ms, row.e2e_ms) == (20.25, 40.0)  # e2e not reported: kept
    later = EdgeTimings(request_id="chatcmpl-1", e2e_ms=45.5)
    write_batch(engine, batch_rows([RecordBatch(seq=2, edge_timings=[later])])[0], [])
    with read_session(engine) as s:
        row = s.get(Request, "chatcmpl-1")
        assert (row.ttft_ms, row.e2e_ms, row.lane) == (20.25, 45.5, "interactive")


class _Broker:
    """A DEALER standing in for the broker's recorder link."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, seq: int, records=(), snapshots=()) -> None:
        msg = RecordBatch(seq=seq, records=list(records), snapshots=list(snapshots))
        self.sock.send_multipart(msg.to_frames())

    def acks(self, timeout_s: float) -> list[int]:
        got = []
        while self.sock.poll(int(timeout_s * 1000)):
            got.append(decode(self.sock.recv_multipart(), (RecordAck,)).seq)
            timeout_s = 0.05
        return got

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_server_writes_then_acks_and_survives_garbage(engine, tmp_path):
    server = RecorderServer(f"ipc://{tmp_path}/rec.sock", engine, flush_interval_s=0.05)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    broker = _Broker(server.bound_addr)
    try:
        broker.sock.send_multipart([b"LS1", b"record_batch", b"\xc1garbage"])
        broker.sock.send_multipart([b"junk"])
        for seq in range(3):
            broker.send(seq, [_rec(seq * 10 + i) for i in range(10)], [_snap("w0", seq)])
        acked = []
        deadline = time.monotonic() + 10
        while len(acked) < 3 and time.monotonic() < deadline:
            acked += broker.acks(1.0)
        assert sorted(acked) == [0, 1, 2]
        assert _count(engine, Request) == 30 and _count(engine, WorkerStat) == 3
        assert server.stats.invalid_messages == 2
    finally:
        server.stop()
        thread.join(10)
        broker.close()
    assert not thread.is_alive()
    assert server.stats.records_written == 30


# --------------------------------------------------------------------------------------------
# The real process.


def _start_recorder(addr: str, db_url: str, *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "laneserve.cli",
            "recorder",
            "--recorder-addr",
            addr,
            "--db",
            db_url,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _wait_acks(broker: _Broker, want: set[int], timeout_s: float) -> set[int]:
    got: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while not want <= got and time.monotonic() < deadline:
        got.update(broker.acks(0.5))
    return got


def _integrity_ok(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    finally:
        engine.dispose()


@pytest.mark.slow
def test_sigkill_mid_write_keeps_every_acknowledged_rec(db_url, tmp_path):
    addr = f"ipc://{tmp_path}/rec.sock"
    proc = _start_recorder(addr, db_url, "--flush-interval", "0.02")
    broker = _Broker(addr)
    batch_size, acked, seq = 200, set(), 0
    try:
        broker.send(seq, [_rec(0)])  # first ack = the recorder is up (migrated, bound)
        acked |= _wait_acks(broker, {0}, 60)
        assert acked == {0}, proc.stdout.read1().decode() if proc.poll() is not None else ""
        deadline = time.monotonic() + 30
        while len(acked) < 30 and time.monotonic() < deadline:  # keep ~8 batches in flight
            if seq - len(acked) < 8:
                seq += 1
                records = [_rec(seq * batch_size + i) for i in range(batch_size)]
                broker.send(seq, records, [_snap("w", seq)])
            acked |= set(broker.acks(0.002))
        for _ in range(5):  # more in flight at the moment of the kill
            seq += 1
            broker.send(seq, [_rec(seq * batch_size + i) for i in range(batch_size)])
        acked |= set(broker.acks(0.01))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        acked |= set(broker.acks(0.05))  # acks already queued before the kill
    finally:
        if proc.poll() is None:
            proc.kill()
        broker.close()
    assert len(acked) >= 10, f"only {len(acked)} batches acknowledged"
    _integrity_ok(db_url)
    engine = make_engine(db_url)
    try:
        with read_session(engine) as s:
            ids = set(s.scalars(sa.select(Request.id)))
            snaps = set(s.scalars(sa.select(WorkerStat.at)))
    finally:
        engine.dispose()
    for n in acked - {0}:
        want = {f"chatcmpl-{n * batch_size + i}" for i in range(batch_size)}
        assert want <= ids, f"acknowledged batch {n} is missing {len(want - ids)} records"
        assert n > seq - 5 or float(n) in snaps
    for n in range(1, seq + 1):  # every batch is all or nothing (one transaction)
        present = sum(f"chatcmpl-{n * batch_size + i}" in ids for i in range(batch_size))
        assert present in (0, batch_size), f"batch {n} half written: {present}"


@pytest.mark.slow
def test_sigterm_flushes_pooled_batches(db_url, tmp_path):
    addr = f"ipc://{tmp_path}/rec.sock"
    proc = _start_recorder(addr, db_url, "--flush-interval", "3600")
    broker = _Broker(addr)
    try:
        broker.send(0, [_rec(0)])
        time.sleep(0.5)
        # Pooled for an hour: only SIGTERM's flush writes and acks it. Wait until it is up.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _has_tables(db_url):
            time.sleep(0.2)
        time.sleep(1.0)
        broker.send(1, [_rec(i) for i in range(1, 100)])
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
        assert proc.returncode == 0, out
        assert _wait_acks(broker, {0, 1}, 5) == {0, 1}
    finally:
        if proc.poll() is None:
            proc.kill()
        broker.close()
    engine = make_engine(db_url)
    try:
        assert _count(engine, Request) == 100
    finally:
        engine.dispose()


def _has_tables(db_url: str) -> bool:
    engine = make_engine(db_url)
    try:
        return "requests" in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


@pytest.mark.slow
def test_exits_when_parent_dies(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'p.db'}"
    addr = f"ipc://{tmp_path}/rec.sock"
    script = (
        f"{sys.executable} -m laneserve.cli recorder --recorder-addr {addr} --db {db_url} "
        "--parent-pid $$ & echo $!; wait"
    )
    parent = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE)
    child_pid = int(parent.stdout.readline())
    time.sleep(3.0)
    assert _alive(child_pid)
    parent.kill()
    parent.wait(5)
    deadline = time.monotonic() + 30
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child_pid), "recorder outlived its parent"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cli_defaults_match_the_library():
    from laneserve.commands import recorder as command
    from laneserve.db import recorder

    assert command.FLUSH_INTERVAL_S == recorder.FLUSH_INTERVAL_S
    assert command.DEFAULT_RETENTION_DAYS * 86400 == recorder.DEFAULT_RETENTION_S


def test_no_ack_while_the_database_is_locked_then_resend_commits(tmp_path):
    import sqlite3

    from laneserve.db import migrate

    url = f"sqlite:///{tmp_path / 'locked.db'}"
    migrate.upgrade(url)
    engine = make_engine(url, busy_timeout_ms=50)
    server = RecorderServer(f"ipc://{tmp_path}/rec.sock", engine, flush_interval_s=0.01)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    broker = _Broker(server.bound_addr)
    holder = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        broker.send(7, [_rec(1)])
        assert broker.acks(1.5) == []
        assert server.stats.transient_errors >= 1
        holder.execute("ROLLBACK")
        broker.send(7, [_rec(1)])  # the broker resends unacknowledged batches
        assert _wait_acks(broker, {7}, 10) == {7}
        assert _count(engine, Request) == 1
    finally:
        holder.close()
        server.stop()
        thread.join(10)
        broker.close()
        engine.dispose()


def test_spec_decode_counts_land_in_their_columns(engine):
    """Speculative decoding's per-request figures (migrations 0003 and 0007) travel through the
    typed record into `requests.spec_draft_tokens` / `spec_accepted_tokens` / `spec_num_drafts`;
    absent ones stay NULL."""
    rows, _ = batch_rows(
        [
            RecordBatch(
                seq=1,
                records=[
                    _rec(1, spec_draft_tokens=40, spec_accepted_tokens=31, spec_num_drafts=12),
                    _rec(2),
                ],
            )
        ]
    )
    result = write_batch(engine, rows, [])
    assert result.records_written == 2, result.errors
    with read_session(engine) as s:
        spec = s.get(Request, "chatcmpl-1")
        plain = s.get(Request, "chatcmpl-2")
        assert (spec.spec_draft_tokens, spec.spec_accepted_tokens, spec.spec_num_drafts) == (
            40, 31, 12,
        )  # fmt: skip
        assert (plain.spec_draft_tokens, plain.spec_accepted_tokens, plain.spec_num_drafts) == (
            None, None, None,
        )  # fmt: skip
