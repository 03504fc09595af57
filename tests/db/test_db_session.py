"""Engine/session behaviour and the models on both backends."""

from __future__ import annotations

import sqlite3
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from laneserve.db.models import File, Job, Request, WorkerStat
from laneserve.db.session import (
    DatabaseURLError,
    make_engine,
    read_session,
    resolve_url,
    write_session,
)


def test_default_url_is_sqlite_under_laneserve_home(laneserve_home):
    url = resolve_url()
    assert url.get_backend_name() == "sqlite"
    assert url.database == str(laneserve_home / "laneserve.db")


def test_env_url_and_explicit_url(laneserve_home, monkeypatch):
    monkeypatch.setenv("LANESERVE_DB_URL", "postgresql://u@127.0.0.1:5432/x")
    assert resolve_url().drivername == "postgresql+psycopg"
    assert resolve_url("sqlite:////tmp/other.db").database == "/tmp/other.db"


@pytest.mark.parametrize("bad", ["mysql://u@h/d", "not a url"])
def test_bad_url_raises_typed_error(bad):
    with pytest.raises(DatabaseURLError):
        resolve_url(bad)


def test_sqlite_pragmas(laneserve_home):
    engine = make_engine()
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    assert (laneserve_home / "laneserve.db").exists()
    engine.dispose()


def test_write_session_takes_the_sqlite_write_lock_at_begin(tmp_path):
    path = tmp_path / "lock.db"
    engine = make_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    other = sqlite3.connect(path, timeout=0.1, isolation_level=None)
    with write_session(engine) as session:
        session.execute(sa.text("SELECT 1"))  # no write yet: the lock is already held
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        assert other.execute("SELECT count(*) FROM t").fetchone() == (0,)  # readers still read
    other.execute("BEGIN IMMEDIATE")  # released after commit
    other.execute("ROLLBACK")
    other.close()
    engine.dispose()


def _job(job_id: str = "batch_1") -> Job:
    return Job(id=job_id, endpoint="/v1/chat/completions", created_at=time.time())


def test_models_round_trip(engine):
    now = time.time()
    with write_session(engine) as s:
        s.add(
            File(
                id="file-in",
                purpose="batch",
                filename="in.jsonl",
                bytes=12,
                path="/x",
                created_at=now,
            )
        )
        s.flush()
        job = _job()
        job.input_file_id = "file-in"
        job.metadata_ = {"k": "v"}
        job.errors = [{"code": "x", "message": "m", "line": 3}]
        s.add(job)
        s.flush()
        s.add(
            Request(id="chatcmpl-1", job_id="batch_1", custom_id="a", body={"messages": [1, "é"]})
        )
        s.add(WorkerStat(worker_id="w0", at=now, lanes="interactive,batch", kv_usage=0.5))
    with read_session(engine) as s:
        job = s.get(Job, "batch_1")
        assert job.status == "validating"
        assert job.request_counts == {"total": 0, "completed": 0, "failed": 0}
        assert job.metadata_ == {"k": "v"} and job.errors[0]["line"] == 3
        req = s.get(Request, "chatcmpl-1")
        assert req.lane == "interactive" and req.attempts == 0 and req.priority == 0
        assert req.body == {"messages": [1, "é"]}
        assert s.scalars(sa.select(WorkerStat.kv_usage)).one() == 0.5


def test_unique_job_custom_id_and_foreign_keys(engine):
    with write_session(engine) as s:
        s.add(_job())
        s.flush()
        s.add(Request(id="r1", job_id="batch_1", custom_id="a"))
    with pytest.raises(IntegrityError):
        with write_session(engine) as s:
            s.add(Request(id="r2", job_id="batch_1", custom_id="a"))
    with pytest.raises(IntegrityError):
        with write_session(engine) as s:
            s.add(Request(id="r3", job_id="no-such-job", custom_id="a"))
    with write_session(engine) as s:  # NULL job_id rows never collide
        s.add_all([Request(id="r4"), Request(id="r5")])
    with read_session(engine) as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Request)) == 3
