"""Fixtures for jobs tests: a migrated database (SQLite in a tmp LANESERVE_HOME, or PostgreSQL)."""

from __future__ import annotations

import pytest


@pytest.fixture
def db_url(laneserve_home) -> str:
    from laneserve.db import migrate

    url = f"sqlite:///{laneserve_home / 'laneserve.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
def engine(db_url):
    from laneserve.db.session import make_engine

    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_db_url(request, laneserve_home) -> str:
    """A migrated database on each backend (PostgreSQL through the shared `pg_url`, or a database of
    its own for a test marked `own_database`)."""
    from laneserve.db import migrate

    if request.param == "sqlite":
        url = f"sqlite:///{laneserve_home / 'laneserve.db'}"
    elif request.node.get_closest_marker("own_database"):
        url = request.getfixturevalue("own_pg_url")
    else:
        url = request.getfixturevalue("pg_url")
    migrate.upgrade(url)
    return url


@pytest.fixture
def any_engine(any_db_url):
    from laneserve.db.session import make_engine

    eng = make_engine(any_db_url)
    yield eng
    eng.dispose()
