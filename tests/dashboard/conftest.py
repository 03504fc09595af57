"""Dashboard fixtures: a migrated, empty database on SQLite and on PostgreSQL (`db_url`,
`db_engine`). Synthetic traffic helpers live in `dashboard_data.py`."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from streamlit.testing.v1 import AppTest

from laneserve import dashboard
from laneserve.db.migrate import upgrade
from laneserve.db.session import make_engine

APP = Path(dashboard.__file__).with_name("app.py")


@pytest.fixture(scope="session")
def _pg_dashboard_url(pg_server_url):
    """A fresh PostgreSQL database for this area's tests, migrated once, dropped at the end."""
    name = f"laneserve_dash_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(pg_server_url).set(database=name).render_as_string(False)
    upgrade(url)
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """A migrated, empty database URL: a fresh SQLite file, or the area's PostgreSQL database
    emptied."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'dash.db'}"
        upgrade(url)
        return url
    url = request.getfixturevalue("_pg_dashboard_url")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE requests, worker_stats, jobs, files CASCADE"))
    engine.dispose()
    return url


@pytest.fixture
def run_app(monkeypatch):
    """`run_app(url)`: the dashboard app run once under AppTest against `url`, no exception."""

    def run(url: str) -> AppTest:
        monkeypatch.setenv("LANESERVE_DB_URL", url)
        at = AppTest.from_file(str(APP), default_timeout=60)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return run


@pytest.fixture
def db_engine(db_url):
    engine = make_engine(db_url)
    yield engine
    engine.dispose()
