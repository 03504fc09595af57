"""Alembic migrations: from empty, back down, concurrent start-up, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa
from alembic import command

from laneserve.cli import main
from laneserve.db import migrate
from laneserve.db.session import make_engine

TABLES = {
    "files",
    "job_leases",
    "jobs",
    "requests",
    "responses",
    "retention_passes",
    "worker_stats",
}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_from_empty_matches_models_and_downgrades_cleanly(db_url):
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == migrate.head_revision()
    assert _tables(db_url) == TABLES | {"alembic_version"}
    command.check(migrate.alembic_config(db_url))  # raises if models and migration differ
    migrate.upgrade(db_url)  # idempotent
    migrate.downgrade(db_url)
    assert migrate.current(db_url) is None
    assert _tables(db_url) == {"alembic_version"}
    migrate.upgrade(db_url)
    assert _tables(db_url) == TABLES | {"alembic_version"}


def test_unknown_revision_raises_migration_error(db_url):
    with pytest.raises(migrate.MigrationError):
        migrate.upgrade(db_url, "ffffffff")


def test_cli_upgrade_current_downgrade(db_url, capsys):
    assert main(["db", "--db", db_url, "current"]) == 0
    assert capsys.readouterr().out.strip() == "none"
    assert main(["db", "--db", db_url, "upgrade"]) == 0
    assert capsys.readouterr().out.strip() == migrate.head_revision()
    assert main(["db", "--db", db_url, "downgrade"]) == 0
    assert capsys.readouterr().out.strip() == "none"
    assert main(["db", "--db", "mysql://x/y", "current"]) == 1


@pytest.mark.slow
def test_three_processes_upgrading_at_once_all_succeed(db_url):
    code = "import sys; from laneserve.db.migrate import upgrade; upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, db_url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert migrate.current(db_url) == migrate.head_revision()
    assert _tables(db_url) == TABLES | {"alembic_version"}
