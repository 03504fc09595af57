"""Schema migrations (Alembic), safe to run from several processes at once.

`upgrade(url)` is what every process calls at start-up: it takes a lock, runs Alembic to
`head`, and releases the lock, so three processes starting together all succeed (one
migrates, the others then find the schema current). The lock is
`pg_advisory_lock(MIGRATION_LOCK_KEY)` on PostgreSQL and a `filelock.FileLock` on
`<database file>.migrate.lock` on SQLite (none for in-memory SQLite).

The Alembic configuration is built in code (`alembic_config`) with `script_location`
pointing at this package's `migrations/` directory, so migrations run from an installed
package without an alembic.ini.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import URL

from laneserve.db.session import make_engine, resolve_url, sqlite_path, writer

logger = logging.getLogger(__name__)
# Alembic logs every plugin it sets up (at import) and every migration step at INFO; keep
# start-up output readable. Set before alembic's first import, or its import-time lines show.
logging.getLogger("alembic").setLevel(logging.WARNING)

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# Arbitrary 64-bit key for pg_advisory_lock ("laneserv" in ASCII); shared by every process.
MIGRATION_LOCK_KEY = 0x6C616E6573657276
# Seconds to wait for another process's migration before giving up.
LOCK_TIMEOUT_S = 120.0


class MigrationError(RuntimeError):
    """A migration could not run (lock timeout, unknown revision, database error)."""


def alembic_config(url: str | URL | None = None) -> Config:
    """An Alembic `Config` for laneserve's migrations and `url` (see `db.session.resolve_url`)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # configparser interpolates '%': escape it (URL-encoded passwords).
    rendered = resolve_url(url).render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision id shipped with this package."""
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None, f"no migrations in {MIGRATIONS_DIR}"
    return head


@contextlib.contextmanager
def migration_lock(engine: Engine, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[Connection]:
    """Hold the cross-process migration lock; yields a connection to migrate with.

    Raises:
        MigrationError: the lock was not acquired within `timeout_s` seconds.
    """
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            # Session-level advisory lock: held across the migration's own transactions.
            conn.execute(
                text("SELECT set_config('lock_timeout', :ms, false)"),
                {"ms": str(int(timeout_s * 1000))},
            )
            try:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            except Exception as exc:
                raise MigrationError(f"migration lock not acquired: {exc}") from exc
            conn.execute(text("SELECT set_config('lock_timeout', '0', false)"))
            conn.commit()
            try:
                yield conn
            finally:
                if conn.in_transaction():
                    conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
                conn.commit()
        return
    path = sqlite_path(engine.url)
    lock = contextlib.nullcontext()
    if path is not None:
        lock = FileLock(str(path) + ".migrate.lock", timeout=timeout_s)
    try:
        lock.__enter__()
    except TimeoutError as exc:
        raise MigrationError(f"migration lock {path}.migrate.lock not acquired: {exc}") from exc
    try:
        with writer(engine).connect() as conn:
            yield conn
    finally:
        lock.__exit__(None, None, None)


def _run(url: str | URL | None, fn, revision: str) -> None:
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with migration_lock(engine) as conn:
            cfg.attributes["connection"] = conn
            fn(cfg, revision)
            if conn.in_transaction():
                conn.commit()
    finally:
        engine.dispose()


def upgrade(url: str | URL | None = None, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (default: the newest), under the lock.

    Idempotent; safe to call from every process at start-up.

    Raises:
        MigrationError: lock timeout or a failed migration.
    """
    try:
        _run(url, command.upgrade, revision)
    except MigrationError:
        raise
    except Exception as exc:
        raise MigrationError(f"upgrade to {revision} failed: {exc}") from exc
    logger.debug("database %s at %s", resolve_url(url).render_as_string(True), revision)


def downgrade(url: str | URL | None = None, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (default: empty), under the lock.

    Raises:
        MigrationError: lock timeout or a failed migration.
    """
    try:
        _run(url, command.downgrade, revision)
    except MigrationError:
        raise
    except Exception as exc:
        raise MigrationError(f"downgrade to {revision} failed: {exc}") from exc


def current(url: str | URL | None = None) -> str | None:
    """The database's current revision id, or None for an unmigrated database."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
