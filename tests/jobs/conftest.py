"""Fixtures for jobs tests: a migrated SQLite database in a tmp LANESERVE_HOME."""

from __future__ import annotations

import pytest


@pytest.fixture
def db_url(laneserve_home) -> str:
    from db import migrate

    url = f"sqlite:///{laneserve_home / 'laneserve.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
def engine(db_url):
    from db.session import make_engine

    eng = make_engine(db_url)
    yield eng
    eng.dispose()
