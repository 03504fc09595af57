"""Fault scenario 8: SIGKILL the recorder during writes (SQLite and PostgreSQL).

Broker + recorder + one synthetic worker; a client finishes requests continuously (32 in flight). After 2 s
the recorder is SIGKILLed, the database is checked at that instant (SQLite ``PRAGMA
integrity_check``; every record the recorder had acknowledged to the broker is there), the
traffic goes on while the recorder is down, then it is started again. The broker resends what
was not acknowledged, so in the end every finished request has exactly one row.
Synthetic worker: the scenario is about durability of records, not tokens.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from tests.harness import Stack, report, run, wait_for

pytestmark = pytest.mark.slow

CONCURRENCY = 32  # requests in flight
TOTAL = 20_000  # upper bound on requests
KILL_AT_S, DOWN_S, AFTER_S = 2.0, 2.0, 2.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> str:
    from laneserve.db import migrate

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'rec.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    migrate.upgrade(url)
    return url


def _rows(engine: sa.Engine, prefix: str) -> int:
    with engine.connect() as conn:
        q = sa.text("SELECT COUNT(*) FROM requests WHERE id LIKE :p")
        return conn.execute(q, {"p": prefix + "%"}).scalar_one()


def _integrity(engine: sa.Engine) -> str:
    if engine.dialect.name != "sqlite":
        with engine.connect() as conn:  # PostgreSQL: the primary key index is usable
            conn.execute(sa.text("SELECT COUNT(DISTINCT id) FROM requests")).scalar_one()
        return "ok"
    with engine.connect() as conn:
        return conn.execute(sa.text("PRAGMA integrity_check")).scalar_one()


def test_recorder_sigkill_during_writes_loses_no_acknowledged_record(db_url) -> None:
    from laneserve.db.session import make_engine

    tmp = Path(tempfile.mkdtemp(prefix="lsr", dir="/tmp"))
    stack = Stack(tmp)
    engine = make_engine(db_url)
    prefix = f"rec-{uuid.uuid4().hex[:8]}-"
    figures: dict = {}
    try:
        stack.start_recorder(db_url)
        stack.start_broker("--recorder", stack.recorder_addr, "--record-resend", "1.0")
        stack.start_worker("w1", "--synthetic-step-ms", "2", "--max-num-seqs", "128")
        stack.wait_workers({"w1"})

        async def one(client: BrokerClient, rid: str) -> object:
            async for msg in client.submit(
                request_id=rid, prompt="x", sampling_params={"max_tokens": 2}, stream=False
            ):
                if not isinstance(msg, p.Delta):
                    return msg
            return None

        done: list[str] = []

        async def main() -> None:
            stop = asyncio.Event()

            async def producer(c: BrokerClient, k: int) -> None:
                i = 0
                while not stop.is_set() and len(done) < TOTAL:
                    rid = f"{prefix}{k:02d}-{i:05d}"
                    i += 1
                    result = await one(c, rid)
                    assert isinstance(result, p.Final), result
                    done.append(rid)

            async with BrokerClient(stack.front) as c:
                tasks = [asyncio.create_task(producer(c, k)) for k in range(CONCURRENCY)]
                await asyncio.sleep(KILL_AT_S)  # writes are going on now
                await asyncio.to_thread(kill_and_check)
                await asyncio.sleep(DOWN_S)  # requests keep finishing while it is down
                figures["finished_while_down"] = len(done) - figures["finished_at_kill"]
                stack.start_recorder(db_url)
                await asyncio.sleep(AFTER_S)
                stop.set()
                await asyncio.gather(*tasks)

        def kill_and_check() -> None:
            wait_for(lambda: _rows(engine, prefix) >= 50, 10, "some rows")
            acked = stack.status()["counters"].get("records_acked", 0)
            stack.kill("recorder")
            figures["finished_at_kill"] = len(done)
            figures["records_acked_at_kill"] = acked
            figures["rows_at_kill"] = _rows(engine, prefix)
            figures["integrity_at_kill"] = _integrity(engine)

        run(main(), timeout_s=120)
        t_restart = time.monotonic()

        def caught_up():
            st = stack.status()
            return st["queues"]["records_unacked"] == 0 and _rows(engine, prefix) == len(done)

        wait_for(caught_up, 60, "the broker to resend every record")
        figures["catch_up_after_restart_s"] = round(time.monotonic() - t_restart, 2)
        assert figures["integrity_at_kill"] == "ok", figures
        # every record the recorder acknowledged before it died was committed
        assert figures["rows_at_kill"] >= figures["records_acked_at_kill"] > 0, figures
        with engine.connect() as conn:
            ids = conn.execute(
                sa.text("SELECT id FROM requests WHERE id LIKE :p"), {"p": prefix + "%"}
            ).scalars()
            ids = list(ids)
        assert sorted(ids) == sorted(done)  # all there, each once
        assert _integrity(engine) == "ok"
        counters = stack.status()["counters"]
        assert counters.get("records_dropped", 0) == 0, counters
        report(
            f"8 recorder SIGKILL during writes ({engine.dialect.name})",
            requests=len(done),
            **figures,
            rows_final=len(ids),
            records_lost=0,
        )
    finally:
        stack.stop()
        engine.dispose()
        shutil.rmtree(tmp, ignore_errors=True)
