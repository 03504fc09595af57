"""Engines and sessions for SQLite (embedded default) and PostgreSQL (same code, another URL).

URL resolution (`resolve_url`): an explicit URL (the `--db` option) wins, then the
`LANESERVE_DB_URL` environment variable, then `sqlite:///$LANESERVE_HOME/laneserve.db`
(`LANESERVE_HOME` defaults to `~/.laneserve`). A plain `postgresql://` or `postgres://` URL
is mapped to the psycopg 3 driver (`postgresql+psycopg://`).

SQLite connections get (DESIGN.md "Storage"): `journal_mode=WAL` (readers never block the
writer), `busy_timeout` (a locked database waits instead of failing at once),
`foreign_keys=ON`, `synchronous=NORMAL` (durable at each WAL checkpoint, safe against process
crashes). Transactions begin with a plain `BEGIN` for reads and `BEGIN IMMEDIATE` for writes
(`write_session`, or any connection from `engine.execution_options(sqlite_begin="IMMEDIATE")`),
so a writer takes the write lock up front instead of failing to upgrade a read lock
(`SQLITE_BUSY` that busy_timeout cannot resolve).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from laneserve.contracts import env
from laneserve.contracts.env import laneserve_home

DB_URL_ENV = "LANESERVE_DB_URL"
HOME_ENV = "LANESERVE_HOME"
SQLITE_FILENAME = "laneserve.db"
# Milliseconds a SQLite connection waits on a lock before raising "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option read by the `begin` hook: "DEFERRED" (default) or "IMMEDIATE".
SQLITE_BEGIN_OPTION = "sqlite_begin"
# Seconds a PostgreSQL connection attempt may take: an unreachable server fails the call (and
# the caller retries) instead of hanging it for the kernel's TCP timeout (minutes).
PG_CONNECT_TIMEOUT_S = 5


class DatabaseURLError(ValueError):
    """The database URL cannot be parsed or names an unsupported backend."""


def resolve_url(url: str | URL | None = None) -> URL:
    """The database URL to use: `url`, else `$LANESERVE_DB_URL`, else the SQLite default.

    Raises:
        DatabaseURLError: unparsable URL, or a backend other than sqlite/postgresql.
    """
    raw = url or env.get(DB_URL_ENV) or f"sqlite:///{laneserve_home() / SQLITE_FILENAME}"
    try:
        parsed = make_url(raw) if isinstance(raw, str) else raw
    except Exception as exc:  # sqlalchemy raises ArgumentError with a terse message
        raise DatabaseURLError(f"invalid database URL {str(raw)!r}: {exc}") from exc
    backend = parsed.get_backend_name()
    if backend in ("postgres", "postgresql"):
        if parsed.drivername in ("postgres", "postgresql"):
            parsed = parsed.set(drivername="postgresql+psycopg")
    elif backend != "sqlite":
        raise DatabaseURLError(
            f"unsupported database backend {backend!r} in {parsed.render_as_string(False)!r};"
            " use sqlite:///PATH or postgresql://..."
        )
    return parsed


def is_sqlite(engine_or_url: Engine | URL | str) -> bool:
    """True when the engine or URL is SQLite."""
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else resolve_url(engine_or_url)
    return url.get_backend_name() == "sqlite"


def sqlite_path(url: URL) -> Path | None:
    """The database file of a SQLite URL, or None for an in-memory database."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser()


def make_engine(
    url: str | URL | None = None, *, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS, **kwargs
) -> Engine:
    """An Engine for `url` (see `resolve_url`), configured for laneserve.

    For SQLite the parent directory of the file is created and every connection is set up
    as described in the module docstring, waiting up to `busy_timeout_ms` (ms) on a lock.
    Extra `kwargs` go to `sqlalchemy.create_engine`.

    Raises:
        DatabaseURLError: see `resolve_url`.
    """
    parsed = resolve_url(url)
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        connect_args = kwargs.pop("connect_args", {})
        connect_args.setdefault("connect_timeout", PG_CONNECT_TIMEOUT_S)
        return create_engine(parsed, connect_args=connect_args, **kwargs)
    path = sqlite_path(parsed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("timeout", busy_timeout_ms / 1000)
    engine = create_engine(parsed, connect_args=connect_args, **kwargs)
    _install_sqlite_hooks(engine, busy_timeout_ms)
    return engine


def _install_sqlite_hooks(engine: Engine, busy_timeout_ms: int) -> None:
    """WAL, busy_timeout, foreign keys, and explicit BEGIN [IMMEDIATE] (SQLAlchemy recipe
    "Serializable isolation / Savepoints / Transactional DDL" for pysqlite)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # Take transaction control away from the sqlite3 module; the `begin` hook emits BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        mode = conn.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        assert mode in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE"), f"bad {SQLITE_BEGIN_OPTION}={mode}"
        conn.exec_driver_sql(f"BEGIN {mode}")


def writer(engine: Engine) -> Engine:
    """`engine` whose transactions take the SQLite write lock at BEGIN (no-op elsewhere)."""
    if engine.dialect.name != "sqlite":
        return engine
    return engine.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})


def session_factory(engine: Engine | str | URL | None = None) -> sessionmaker[Session]:
    """A `sessionmaker` bound to `engine` (an Engine, a URL, or None for `make_engine()`).

    Sessions from it begin with a plain BEGIN (reads); use `write_session` for writes.
    `expire_on_commit=False` so rows stay readable after commit.
    """
    if not isinstance(engine, Engine):
        engine = make_engine(engine)
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextlib.contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """A Session in one write transaction (`BEGIN IMMEDIATE` on SQLite), committed on exit.

    Rolls back and re-raises on any exception. Keep the body short: on SQLite it holds the
    database's single write lock.
    """
    with Session(bind=writer(engine), expire_on_commit=False) as session:
        with session.begin():
            yield session


@contextlib.contextmanager
def read_session(engine: Engine) -> Iterator[Session]:
    """A Session for reads (plain BEGIN); rolled back on exit."""
    with Session(bind=engine, expire_on_commit=False) as session:
        yield session
