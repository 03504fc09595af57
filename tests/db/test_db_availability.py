"""`db.availability` on real errors: which failures a process may wait out (database away, disk
full) and which are a bad row; and `Outage`'s backoff. No mocks: SQLite runs out of pages
(`PRAGMA max_page_count`), PostgreSQL is asked on a port where nothing listens."""

from __future__ import annotations

import errno
import logging
import socket

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from laneserve.db.availability import Outage, can_wait_out, database_unavailable, storage_full
from laneserve.db.session import make_engine


def _error(engine: sa.Engine, *statements: str) -> DBAPIError:
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        for stmt in statements:
            conn.exec_driver_sql(stmt)
    return caught.value


def test_sqlite_full_is_storage_full_and_a_bad_row_is_neither(tmp_path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'small.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        conn.exec_driver_sql("INSERT INTO t VALUES (1, 'x')")
    full = _error(
        engine,
        "PRAGMA max_page_count = 8",
        "INSERT INTO t (v) SELECT hex(randomblob(4000)) FROM t",
        *["INSERT INTO t (v) SELECT v FROM t"] * 8,
    )
    assert "full" in str(full.orig)
    assert storage_full(full) and can_wait_out(full)
    duplicate = _error(engine, "INSERT INTO t VALUES (1, 'again')")
    assert not storage_full(duplicate) and not database_unavailable(duplicate)
    assert not can_wait_out(duplicate)
    engine.dispose()


def test_unreachable_postgresql_is_unavailable_not_full() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = make_engine(f"postgresql://postgres@127.0.0.1:{port}/postgres")
    exc = _error(engine, "SELECT 1")
    assert database_unavailable(exc) and can_wait_out(exc) and not storage_full(exc)
    engine.dispose()


def test_os_errors_full_or_not() -> None:
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert storage_full(OSError(code, "full"))
    assert not storage_full(OSError(errno.EACCES, "denied"))
    assert not storage_full(ValueError("x"))


def test_outage_logs_once_and_backs_off(caplog) -> None:
    outage = Outage("waiting", logging.getLogger("test.outage"), backoff=(0.5, 2.0))
    exc = OSError(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.WARNING, "test.outage"):
        delays = [outage.failed(exc) for _ in range(5)]
        assert outage.down and outage.full and outage.count == 1
        outage.ok()
        outage.ok()
    assert delays == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert not outage.down
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("the disk is full") and "writes go through again" in messages[1]
