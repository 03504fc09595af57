"""Fixtures for the db tests: every SQL test runs on SQLite and on PostgreSQL.

`db_url` is a fresh, empty database per test: a SQLite file under tmp_path, or a new database
created on the server of `LANESERVE_TEST_PG_URL` (skipped without one, failed in CI).
"""

from __future__ import annotations

import os
import uuid

import pytest
import sqlalchemy as sa

from laneserve.db import migrate
from laneserve.db.session import make_engine


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'laneserve.db'}"
        return
    server = request.getfixturevalue("pg_server_url")
    name = f"laneserve_db_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        reason = f"cannot create a PostgreSQL database at {server}: {exc}"
        if os.environ.get("LANESERVE_REQUIRE_ALL") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    url = sa.engine.make_url(server).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def engine(db_url) -> sa.Engine:
    """An engine on a migrated (head) database."""
    migrate.upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()
