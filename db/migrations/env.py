"""Alembic environment for laneserve.

Run through `db.migrate` (programmatic `Config`, no alembic.ini needed), which hands over an
open connection in `config.attributes["connection"]`. Running `alembic` directly with
`-x url=...` or `sqlalchemy.url` set also works.
"""

from __future__ import annotations

from alembic import context

from laneserve.db.models import Base
from laneserve.db.session import make_engine, writer

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTER via table copy
        compare_type=True,
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade --sql`)."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    engine = make_engine(url)
    try:
        with writer(engine).connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
